//! The plan as the start-up log's table.

use super::{Placement, Plan, UnitPlan};
use crate::util::fmt_bytes;

impl Plan {
    /// The plan as a table for the start-up log.
    pub fn table(&self) -> String {
        let mut s = String::new();
        s.push_str("memory plan\n");
        line(&mut s, "device budget", fmt_bytes(self.device_budget));
        line(&mut s, "KV cache", fmt_bytes(self.kv_cache_bytes));
        line(&mut s, "workspace", fmt_bytes(self.workspace_bytes));
        if self.backend_bytes > 0 {
            line(&mut s, "backend scratch", fmt_bytes(self.backend_bytes));
        }
        if self.self_draft_bytes > 0 {
            line(
                &mut s,
                "self-draft",
                format!(
                    "{} (its KV cache, workspace and quantized copies of the streamed units)",
                    fmt_bytes(self.self_draft_bytes)
                ),
            );
        }
        line(
            &mut s,
            "streaming slots",
            format!(
                "{} x {}",
                self.stream_slots,
                fmt_bytes(self.stream_slot_bytes)
            ),
        );
        line(
            &mut s,
            "resident weights",
            format!(
                "{} ({} units)",
                fmt_bytes(self.resident_bytes),
                self.layers_resident()
            ),
        );
        if self.embedding_gathered {
            line(
                &mut s,
                "embedding rows",
                format!(
                    "gathered per step (a frame of at most {} per distinct token) into {}",
                    fmt_bytes(self.gather_bytes_per_token),
                    fmt_bytes(self.gather_table_bytes)
                ),
            );
        }
        if !self.head_parts.is_empty() {
            line(
                &mut s,
                "output head (tied)",
                format!(
                    "the embedding in {} row parts of at most {} rows",
                    self.head_parts.len(),
                    self.head_parts
                        .iter()
                        .map(|p| p.rows.end - p.rows.start)
                        .max()
                        .unwrap_or(0)
                ),
            );
        }
        self.expert_lines(&mut s);
        line(&mut s, "device total", fmt_bytes(self.device_bytes()));
        line(
            &mut s,
            "host cache",
            format!(
                "{} ({} units)",
                fmt_bytes(self.host_cache_bytes),
                self.units
                    .iter()
                    .filter(|u| u.placement == Placement::HostCached)
                    .count()
            ),
        );
        self.cpu_lines(&mut s);
        line(&mut s, "prefetch depth", self.prefetch.to_string());
        self.host_lines(&mut s);
        line(
            &mut s,
            "per pass from disk",
            fmt_bytes(self.disk_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass from host cache",
            fmt_bytes(self.host_cache_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass uploaded",
            fmt_bytes(self.upload_bytes_per_pass),
        );
        self.unit_runs(&mut s);
        s
    }

    /// The decoder layers computed on the host CPU, and what they hold there; those of the
    /// other devices.
    fn cpu_lines(&self, s: &mut String) {
        for d in &self.devices {
            line(
                s,
                &d.name,
                format!(
                    "decoder layers {} .. {} resident: weights {}, KV cache {}, workspace {}, backend {}; {} of {}",
                    d.layers.start,
                    d.layers.end.saturating_sub(1),
                    fmt_bytes(d.weights_bytes),
                    fmt_bytes(d.kv_cache_bytes),
                    fmt_bytes(d.workspace_bytes),
                    fmt_bytes(d.backend_bytes),
                    fmt_bytes(d.total()),
                    fmt_bytes(d.budget)
                ),
            );
        }
        if self.cpu_layers == 0 {
            return;
        }
        line(
            s,
            "CPU layers",
            format!(
                "{} (decoder layers 0 .. {}) computed on the host: weights {}, KV cache {}, workspace {}",
                self.cpu_layers,
                self.cpu_layers - 1,
                fmt_bytes(self.cpu_weights_bytes),
                fmt_bytes(self.cpu_kv_cache_bytes),
                fmt_bytes(self.cpu_workspace_bytes)
            ),
        );
    }

    /// A mixture's streamed experts: the cache, its hot slots, the resident dense parts.
    fn expert_lines(&self, s: &mut String) {
        if self.experts_streamed > 0 {
            line(
                s,
                "expert cache",
                format!(
                    "{} x {} (of {} experts in {} streamed layers)",
                    self.expert_cache_slots,
                    fmt_bytes(self.expert_slot_bytes),
                    self.experts_streamed,
                    self.sparse.iter().flatten().count()
                ),
            );
            if self.expert_hot_slots > 0 {
                line(
                    s,
                    "resident hot experts",
                    format!(
                        "{} of the cache's slots, {} (the profile's hottest, never evicted)",
                        self.expert_hot_slots,
                        fmt_bytes(self.expert_hot_slots as u64 * self.expert_slot_bytes)
                    ),
                );
            }
            line(
                s,
                "resident dense parts",
                format!(
                    "{} ({} of the streamed layers: norms, attention, router)",
                    fmt_bytes(self.dense_resident_bytes),
                    self.dense_resident.iter().filter(|&&d| d).count()
                ),
            );
            line(
                s,
                "expert loads in flight",
                format!(
                    "{} (only the experts a step routes to load)",
                    self.expert_reads
                ),
            );
        }
    }

    /// Every host role.
    fn host_lines(&self, s: &mut String) {
        let h = &self.host;
        s.push_str(
            "  host
",
        );
        line(
            s,
            "  budget",
            match h.budget {
                Some(b) => fmt_bytes(b),
                None => "not limited".into(),
            },
        );
        line(s, "  process overhead", fmt_bytes(h.overhead_bytes));
        if h.read_buffers > 0 {
            line(
                s,
                "  read buffers",
                format!(
                    "{} x {}, up to {} in flight",
                    h.read_buffers,
                    fmt_bytes(h.request_bytes),
                    h.reads_in_flight
                ),
            );
        } else {
            line(
                s,
                "  read buffers",
                format!(
                    "none: reads of {} land in the staging slots, up to {} in flight",
                    fmt_bytes(h.request_bytes),
                    h.reads_in_flight
                ),
            );
        }
        line(
            s,
            "  staging slots",
            format!("{} x {}", h.staging_slots, fmt_bytes(h.staging_slot_bytes)),
        );
        line(s, "  decoder scratch", fmt_bytes(h.scratch_bytes));
        if h.compute_scratch_bytes > 0 {
            line(s, "  compute scratch", fmt_bytes(h.compute_scratch_bytes));
        }
        line(s, "  logits and samplers", fmt_bytes(h.sampling_bytes));
        if h.gather_bytes > 0 {
            line(s, "  embedding row gather", fmt_bytes(h.gather_bytes));
        }
        if h.arena_bytes > 0 {
            line(s, "  device arena (= host)", fmt_bytes(h.arena_bytes));
        }
        if h.host_cache_bytes > 0 {
            line(s, "  host cache", fmt_bytes(h.host_cache_bytes));
        }
        if h.cpu_layers_bytes > 0 {
            line(
                s,
                "  CPU layers",
                format!(
                    "{} (with their compute scratch)",
                    fmt_bytes(h.cpu_layers_bytes)
                ),
            );
        }
        if h.kv_cache_host_bytes > 0 {
            line(
                s,
                "  prefix KV (host tier)",
                fmt_bytes(h.kv_cache_host_bytes),
            );
        }
        if h.load_transient_bytes > 0 {
            line(
                s,
                "  staging while loading",
                fmt_bytes(h.load_transient_bytes),
            );
        }
        line(s, "  host total", fmt_bytes(h.total_bytes));
    }

    /// Runs of units with the same placement, e.g. "layers 0-11 resident".
    fn unit_runs(&self, s: &mut String) {
        let how = |u: &UnitPlan| match (u.placement, u.pieces) {
            (Placement::Host, _) => "computed on the host CPU".to_string(),
            (Placement::OtherDevice, _) => "resident on another device".to_string(),
            (p, 0) => format!("{p:?}"),
            (p, n) => format!("{p:?} in {n} pieces"),
        };
        let mut i = 0;
        while i < self.units.len() {
            let p = how(&self.units[i]);
            let mut j = i;
            while j + 1 < self.units.len() && how(&self.units[j + 1]) == p {
                j += 1;
            }
            let name = if i == j {
                self.units[i].unit.clone()
            } else {
                format!("{} .. {}", self.units[i].unit, self.units[j].unit)
            };
            s.push_str(&format!("  {name:<28} {p}\n"));
            i = j + 1;
        }
    }
}

/// A table line: the role, padded, and its value.
fn line(s: &mut String, k: &str, v: String) {
    s.push_str(&format!("  {k:<28} {v}\n"));
}
