//! The daemon's metrics in the Prometheus text exposition format (version 0.0.4), served
//! at `GET /metrics`. Request counters and latency histograms are kept here, as requests
//! run through `api.rs`; the engine's gauges and totals (queue, sequences, passes, bytes
//! and per-stage seconds) are read from the scheduler's status when the page is rendered.
//! Names and units follow Prometheus conventions: `sluice_…_total` counters, `_seconds`
//! and `_bytes` units.

use crate::engine::scheduler::Status;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Which wire a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Api {
    Grpc,
    Http,
}

impl Api {
    fn label(self) -> &'static str {
        match self {
            Api::Grpc => "grpc",
            Api::Http => "http",
        }
    }
}

/// A histogram with fixed upper bounds (seconds); counts are cumulative when rendered.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, help, "histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// Time to first token and end-to-end latency: from a millisecond to minutes (a streamed
/// 50 GB model on a slow disk takes seconds per pass).
const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Time per output token: from 1 ms (resident on a GPU) to 20 s (streaming from disk).
const TOKEN_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
];

struct Inner {
    /// Requests by (api, outcome): a finish reason, or the error that ended them.
    requests: BTreeMap<(Api, &'static str), u64>,
    prompt_tokens: u64,
    generation_tokens: u64,
    ttft: Histogram,
    per_token: Histogram,
    e2e: Histogram,
}

pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                prompt_tokens: 0,
                generation_tokens: 0,
                ttft: Histogram::new(LATENCY_BOUNDS),
                per_token: Histogram::new(TOKEN_BOUNDS),
                e2e: Histogram::new(LATENCY_BOUNDS),
            }),
        }
    }
}

/// What the rendered page says about the model and its plan, besides the engine's status.
#[derive(Clone, Default)]
pub struct Static {
    pub model: String,
    pub backend: String,
    pub numerics: &'static str,
    pub kv_dtype: String,
    pub device_bytes_budget: u64,
    pub host_bytes_budget: u64,
    pub host_bytes_planned: u64,
    pub kv_cache_bytes: u64,
    pub host_cache_bytes: u64,
    pub bytes_streamed_per_pass: u64,
    pub layers_resident: u64,
    pub layers_streamed: u64,
    /// Decoder layers the host CPU computes (`Plan::cpu_layers`).
    pub layers_cpu: u64,
}

impl Static {
    /// The page's figures for model `model` served by `backend` under `plan`.
    pub fn of(
        model: &str,
        backend: &str,
        numerics: &'static str,
        kv_dtype: String,
        plan: &crate::plan::Plan,
    ) -> Static {
        Static {
            model: model.to_string(),
            backend: backend.into(),
            numerics,
            kv_dtype,
            device_bytes_budget: plan.device_budget,
            host_bytes_budget: plan.host.budget.unwrap_or(0),
            host_bytes_planned: plan.host.total_bytes,
            kv_cache_bytes: plan.kv_cache_bytes,
            host_cache_bytes: plan.host_cache_bytes,
            bytes_streamed_per_pass: plan.upload_bytes_per_pass,
            layers_resident: plan.layers_resident() as u64,
            layers_streamed: plan.layers_streamed() as u64,
            layers_cpu: plan.cpu_layers as u64,
        }
    }
}

impl Static {
    /// The figures of the plan in use, where a change of placement replaced the one
    /// loaded.
    fn in_use(&self, s: &Status) -> Option<Static> {
        let p = s.following.as_ref().and_then(|f| f.plan.as_deref())?;
        Some(Static::of(
            &self.model,
            &self.backend,
            self.numerics,
            self.kv_dtype.clone(),
            p,
        ))
    }
}

/// The units by placement, and the placement's changes where it follows the batch
/// (placement auto).
fn render_placement(out: &mut String, st: &Static, s: &Status) {
    header(
        out,
        "sluice_layers",
        "Units of the model by placement.",
        "gauge",
    );
    for (placement, n) in [
        ("resident", st.layers_resident),
        ("streamed", st.layers_streamed),
        ("cpu", st.layers_cpu),
    ] {
        let _ = writeln!(out, "sluice_layers{{placement=\"{placement}\"}} {n}");
    }
    let Some(f) = &s.following else { return };
    scalar(
        out,
        "sluice_placement_changes_total",
        "Changes of placement made following the batch (placement auto).",
        "counter",
        f.changes,
    );
    scalar(
        out,
        "sluice_placement_last_change_seconds",
        "Seconds the engine stopped for the last change of placement.",
        "gauge",
        f.last_change_s,
    );
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn scalar(out: &mut String, name: &str, help: &str, kind: &str, v: impl std::fmt::Display) {
    header(out, name, help, kind);
    let _ = writeln!(out, "{name} {v}");
}

/// A counter family with one label, a sample per value.
fn labeled(out: &mut String, name: &str, help: &str, label: &str, samples: &[(&str, f64)]) {
    header(out, name, help, "counter");
    for (value, v) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {v}");
    }
}

/// The model served and how, as labels of a constant gauge.
fn model_info(out: &mut String, st: &Static) {
    header(
        out,
        "sluice_model_info",
        "The model served and how (always 1).",
        "gauge",
    );
    let _ = writeln!(
        out,
        "sluice_model_info{{model=\"{}\",backend=\"{}\",numerics=\"{}\",kv_dtype=\"{}\"}} 1",
        label(&st.model),
        label(&st.backend),
        st.numerics,
        label(&st.kv_dtype)
    );
}

/// Speculative decoding's counters and the histogram of tokens per decode step.
fn speculative(out: &mut String, s: &crate::engine::draft::SpecStats) {
    scalar(
        out,
        "sluice_draft_tokens_total",
        "Drafted tokens that passes verified (speculative decoding).",
        "counter",
        s.drafted_tokens,
    );
    scalar(
        out,
        "sluice_draft_accepted_tokens_total",
        "Drafted tokens the sequences' own sampling agreed with.",
        "counter",
        s.accepted_tokens,
    );
    tokens_per_step(out, &s.tokens_per_step);
    scalar(
        out,
        "sluice_draft_passes_total",
        "Passes of the draft model (speculative decoding with --draft STORE).",
        "counter",
        s.draft_passes,
    );
    scalar(
        out,
        "sluice_draft_seconds_total",
        "Wall time of the draft model's passes.",
        "counter",
        s.draft_seconds,
    );
}

/// Speculative decoding's and the prefix cache's counters.
fn engine_counters(out: &mut String, s: &crate::engine::scheduler::Status) {
    speculative(out, &s.speculative);
    prefix_cache(out, &s.prefix_cache);
}

/// The prefix cache's counters and what its slots keep.
fn prefix_cache(out: &mut String, p: &crate::engine::prefix::PrefixStats) {
    let rows: [(&str, &str, &str, u64); 8] = [
        (
            "sluice_prefix_cache_prompts_total",
            "Prompts admitted.",
            "counter",
            p.prompts,
        ),
        (
            "sluice_prefix_cache_hits_total",
            "Prompts that took KV from the prefix cache.",
            "counter",
            p.hits,
        ),
        (
            "sluice_prefix_cache_prompt_tokens_total",
            "Prompt tokens admitted.",
            "counter",
            p.prompt_tokens,
        ),
        (
            "sluice_prefix_cache_cached_tokens_total",
            "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
            "counter",
            p.cached_tokens,
        ),
        (
            "sluice_prefix_cache_evictions_total",
            "KV slots whose kept KV was given up for a prompt that shared nothing with it.",
            "counter",
            p.evictions,
        ),
        (
            "sluice_prefix_cache_kept_slots",
            "Free KV slots keeping a finished sequence's KV.",
            "gauge",
            p.kept_slots as u64,
        ),
        (
            "sluice_prefix_cache_kept_tokens",
            "Positions of KV the kept slots hold.",
            "gauge",
            p.kept_tokens,
        ),
        (
            "sluice_prefix_cache_kept_bytes",
            "Bytes of KV cache the kept positions take.",
            "gauge",
            p.kept_bytes,
        ),
    ];
    for (name, help, kind, v) in rows {
        scalar(out, name, help, kind, v);
    }
    prefix_tiers(out, &p.tiers);
}

/// The prefix cache's host and disk tiers.
fn prefix_tiers(out: &mut String, t: &crate::engine::kv_tiers::TierStats) {
    let rows: [(&str, &str, &str, u64); 12] = [
        (
            "sluice_prefix_cache_host_budget_bytes",
            "Bytes the host tier may hold (inside the plan's host memory).",
            "gauge",
            t.host_budget_bytes,
        ),
        (
            "sluice_prefix_cache_host_bytes",
            "Bytes of KV blocks the host tier holds.",
            "gauge",
            t.host_bytes,
        ),
        (
            "sluice_prefix_cache_host_blocks",
            "KV blocks the host tier holds.",
            "gauge",
            t.host_blocks,
        ),
        (
            "sluice_prefix_cache_host_hits_total",
            "Prompts that took their prefix from the host tier.",
            "counter",
            t.host_hits,
        ),
        (
            "sluice_prefix_cache_host_tokens_total",
            "Prompt tokens the host tier gave.",
            "counter",
            t.host_tokens,
        ),
        (
            "sluice_prefix_cache_disk_budget_bytes",
            "Bytes the disk tier may hold (0: no disk tier).",
            "gauge",
            t.disk.budget_bytes,
        ),
        (
            "sluice_prefix_cache_disk_bytes",
            "Bytes of KV block files in the disk tier (every model's).",
            "gauge",
            t.disk.bytes,
        ),
        (
            "sluice_prefix_cache_disk_blocks",
            "KV block files in the disk tier (every model's).",
            "gauge",
            t.disk.blocks,
        ),
        (
            "sluice_prefix_cache_disk_hits_total",
            "Prompts that read at least one block of their prefix from disk.",
            "counter",
            t.disk_hits,
        ),
        (
            "sluice_prefix_cache_disk_tokens_total",
            "Prompt tokens those prompts took from the tiers.",
            "counter",
            t.disk_tokens,
        ),
        (
            "sluice_prefix_cache_disk_write_errors_total",
            "Blocks the disk tier failed to write (a full disk): each a later miss.",
            "counter",
            t.disk.write_errors,
        ),
        (
            "sluice_prefix_cache_disk_read_errors_total",
            "Block files that failed their checks when read back (deleted; each a miss).",
            "counter",
            t.disk.read_errors,
        ),
    ];
    for (name, help, kind, v) in rows {
        scalar(out, name, help, kind, v);
    }
}

/// The histogram of tokens a sequence's decode step yielded (more than one where drafts
/// were accepted), its buckets cumulative as the text format wants them.
fn tokens_per_step(out: &mut String, counts: &[u64]) {
    let name = "sluice_tokens_per_step";
    header(
        out,
        name,
        "Tokens a sequence's decode step yielded: its own, and the drafts it accepted.",
        "histogram",
    );
    let (mut seen, mut sum) = (0u64, 0u64);
    for (i, &n) in counts.iter().enumerate() {
        seen += n;
        sum += (i as u64 + 1) * n;
        if i + 1 < counts.len() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {seen}", i + 1);
        }
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {seen}");
    let _ = writeln!(out, "{name}_sum {sum}");
    let _ = writeln!(out, "{name}_count {seen}");
}

/// A label value as the text format wants it: backslash, quote and newline escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave it inconsistent (plain counters).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request ended with `outcome` (a finish reason or an error code).
    pub fn request(&self, api: Api, outcome: &'static str) {
        *self.lock().requests.entry((api, outcome)).or_default() += 1;
    }

    pub fn tokens(&self, prompt: usize, generated: usize) {
        let mut m = self.lock();
        m.prompt_tokens += prompt as u64;
        m.generation_tokens += generated as u64;
    }

    pub fn first_token(&self, seconds: f64) {
        self.lock().ttft.observe(seconds);
    }

    /// `n` tokens arrived together `seconds` after the previous ones.
    pub fn next_tokens(&self, seconds: f64, n: usize) {
        let mut m = self.lock();
        for _ in 0..n {
            m.per_token.observe(seconds / n as f64);
        }
    }

    pub fn finished(&self, seconds: f64) {
        self.lock().e2e.observe(seconds);
    }

    /// The page: this registry's counters and histograms, then the engine's status.
    /// The page: request counters and histograms of every model, then the gauges and totals
    /// of one loaded model (the default, else the one used last; they restart when it is
    /// reloaded) and the number loaded.
    pub fn render(&self, model: Option<(&Status, &Static)>, loaded: usize) -> String {
        let none = (Status::default(), Static::default());
        let (status, st) = model.unwrap_or((&none.0, &none.1));
        let mut out = self.render_model(status, st);
        scalar(
            &mut out,
            "sluice_models_loaded",
            "Models loaded now (the gauges above describe one of them).",
            "gauge",
            loaded,
        );
        out
    }

    fn render_model(&self, s: &Status, st: &Static) -> String {
        let mut out = String::with_capacity(8 << 10);
        let now = st.in_use(s);
        let st = now.as_ref().unwrap_or(st);
        {
            let m = self.lock();
            header(
                &mut out,
                "sluice_requests_total",
                "Generation requests by wire and outcome (a finish reason, or the error that refused or ended them).",
                "counter",
            );
            for ((api, outcome), n) in &m.requests {
                let _ = writeln!(
                    out,
                    "sluice_requests_total{{api=\"{}\",outcome=\"{}\"}} {n}",
                    api.label(),
                    label(outcome)
                );
            }
            scalar(
                &mut out,
                "sluice_prompt_tokens_total",
                "Prompt tokens of the requests that ran.",
                "counter",
                m.prompt_tokens,
            );
            scalar(
                &mut out,
                "sluice_generation_tokens_total",
                "Tokens generated.",
                "counter",
                m.generation_tokens,
            );
            m.ttft.render(
                &mut out,
                "sluice_time_to_first_token_seconds",
                "Seconds from a request's arrival to its first text, as the client sees it (queueing included).",
            );
            m.per_token.render(
                &mut out,
                "sluice_time_per_output_token_seconds",
                "Seconds between generated tokens after the first.",
            );
            m.e2e.render(
                &mut out,
                "sluice_request_duration_seconds",
                "Seconds from a request's arrival to its end.",
            );
        }
        let t = &s.totals;
        let io = &s.io;
        // Gauges, and counters (named `_total`).
        let scalars: [(&str, &str, f64); 20] = [
            (
                "sluice_queue_depth",
                "Requests waiting for a KV slot.",
                s.queue_depth as f64,
            ),
            (
                "sluice_active_sequences",
                "Sequences in the batch.",
                s.active_sequences as f64,
            ),
            (
                "sluice_decode_tokens_per_second",
                "Decode tokens per second over all sequences, smoothed over steps.",
                s.decode_tokens_per_s,
            ),
            (
                "sluice_last_pass_seconds",
                "Seconds the last pass over the weights took.",
                s.last_pass_time_s,
            ),
            (
                "sluice_device_memory_peak_bytes",
                "Peak device memory allocated (on the CPU backend: the arena).",
                s.device_bytes_peak as f64,
            ),
            (
                "sluice_device_memory_budget_bytes",
                "The device memory budget the plan fits in.",
                st.device_bytes_budget as f64,
            ),
            (
                "sluice_host_memory_budget_bytes",
                "The host memory budget (0: none).",
                st.host_bytes_budget as f64,
            ),
            (
                "sluice_host_memory_planned_bytes",
                "Host memory the plan accounts for.",
                st.host_bytes_planned as f64,
            ),
            (
                "sluice_host_memory_peak_bytes",
                "Peak host memory: the memory cgroup's peak when the daemon is alone in a limited one, else the peak resident set (VmHWM).",
                crate::hostmem::host_peak().0 as f64,
            ),
            (
                "sluice_kv_cache_bytes",
                "Bytes of the KV cache.",
                st.kv_cache_bytes as f64,
            ),
            (
                "sluice_host_cache_bytes",
                "Bytes of the host cache of decompressed streamed layers.",
                st.host_cache_bytes as f64,
            ),
            (
                "sluice_streamed_bytes_per_pass",
                "Weight bytes that stream in every pass.",
                st.bytes_streamed_per_pass as f64,
            ),
            (
                "sluice_passes_total",
                "Forward passes over the weights.",
                t.passes as f64,
            ),
            (
                "sluice_disk_read_bytes_total",
                "Bytes read from the store by the I/O engine.",
                io.read_bytes as f64,
            ),
            (
                "sluice_decompressed_bytes_total",
                "Raw bytes the decompression workers produced.",
                io.decompressed_bytes as f64,
            ),
            (
                "sluice_uploaded_bytes_total",
                "Weight bytes handed to the device (copied, or lent on a unified backend).",
                t.bytes_uploaded as f64,
            ),
            (
                "sluice_host_cache_hit_bytes_total",
                "Streamed bytes served from the host cache instead of the disk.",
                t.bytes_from_host_cache as f64,
            ),
            (
                "sluice_io_read_ops_total",
                "Read requests the I/O engine completed.",
                io.read_ops as f64,
            ),
            (
                "sluice_units_streamed_total",
                "Streamed units the I/O engine delivered.",
                io.units_done as f64,
            ),
            (
                "sluice_units_failed_total",
                "Streamed units that failed (checksum, decode or read errors).",
                io.units_failed as f64,
            ),
        ];
        for (name, help, v) in scalars {
            let kind = if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            };
            scalar(&mut out, name, help, kind, v);
        }
        render_placement(&mut out, st, s);
        labeled(
            &mut out,
            "sluice_stage_busy_seconds_total",
            "Seconds each stage was busy: disk_read (a read in flight), decompress (summed over workers), upload, compute.",
            "stage",
            &[
                ("disk_read", io.read_busy_s),
                ("decompress", io.decompress_busy_s),
                ("upload", t.upload_s),
                ("compute", t.compute_s),
            ],
        );
        labeled(
            &mut out,
            "sluice_stage_stall_seconds_total",
            "Seconds a stage waited on another: compute on loads, reads on read buffers, requests on staging slots.",
            "stage",
            &[
                ("compute_waiting_for_load", t.load_stall_s),
                ("read_waiting_for_buffer", io.buffer_stall_s),
                ("load_waiting_for_slot", io.slot_stall_s),
            ],
        );
        engine_counters(&mut out, s);
        model_info(&mut out, st);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_label_values_are_escaped() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 5.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "help");
        assert!(out.contains("x_seconds_bucket{le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_seconds_count 4\n"), "{out}");
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn tokens_per_step_is_a_cumulative_histogram() {
        let mut counts = [0u64; 17];
        counts[0] = 5; // five steps of one token
        counts[2] = 2; // two of three
        counts[16] = 1; // one of 17 or more (counted as 17 in the sum)
        let mut out = String::new();
        tokens_per_step(&mut out, &counts);
        for want in [
            "sluice_tokens_per_step_bucket{le=\"1\"} 5\n",
            "sluice_tokens_per_step_bucket{le=\"3\"} 7\n",
            "sluice_tokens_per_step_bucket{le=\"16\"} 7\n",
            "sluice_tokens_per_step_bucket{le=\"+Inf\"} 8\n",
            "sluice_tokens_per_step_sum 28\n",
            "sluice_tokens_per_step_count 8\n",
        ] {
            assert!(out.contains(want), "{want:?} in {out}");
        }
    }
}
