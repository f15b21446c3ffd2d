//! `sluice status`'s pieces: the Status reply as JSON, and its lines on placement,
//! speculative decoding, the prefix cache and a mixture's experts.

use sluice_client::pb;

/// Speculative decoding's counts in `sluice status --json`.
pub(crate) fn speculative_json(x: &pb::Speculative) -> serde_json::Value {
    serde_json::json!({
        "drafter": x.drafter,
        "drafted_tokens": x.drafted_tokens,
        "accepted_tokens": x.accepted_tokens,
        "tokens_per_step": x.tokens_per_step,
        "draft_passes": x.draft_passes,
        "draft_seconds": x.draft_seconds,
        "pass_seconds": x.pass_seconds,
    })
}

/// `sluice status`'s line on speculative decoding, when the model drafts, and the draft
/// model's share of the engine's time.
pub(crate) fn print_speculative(x: Option<&pb::Speculative>) {
    let Some(x) = x.filter(|x| !x.drafter.is_empty()) else {
        return;
    };
    let steps: u64 = x.tokens_per_step.iter().sum();
    let tokens: u64 = (1..).zip(&x.tokens_per_step).map(|(i, n)| i * n).sum();
    println!(
        "drafting         {}: {} of {} drafted tokens accepted ({:.2}); {:.2} tokens a decode step",
        x.drafter,
        x.accepted_tokens,
        x.drafted_tokens,
        x.accepted_tokens as f64 / x.drafted_tokens.max(1) as f64,
        tokens as f64 / steps.max(1) as f64
    );
    if x.draft_passes > 0 {
        println!(
            "draft model      {} passes, {:.1} s: {:.0} % of the engine's time",
            x.draft_passes,
            x.draft_seconds,
            100.0 * x.draft_seconds / (x.draft_seconds + x.pass_seconds).max(1e-9)
        );
    }
}

/// `sluice status --json`: the Status reply as one object.
pub(crate) fn status_json(st: &pb::StatusResponse) -> serde_json::Value {
    let layers: Vec<_> = st.layers.iter().map(|l| serde_json::json!({"layer": l.layer, "placement": l.placement, "raw_bytes": l.raw_bytes})).collect();
    let stages: Vec<_> = st.stages.iter().map(|s| serde_json::json!({"stage": s.stage, "bytes_per_s": s.bytes_per_s, "seconds_last_pass": s.stall_s})).collect();
    serde_json::json!({
        "model": st.model, "backend": st.backend, "device_bytes_budget": st.device_bytes_budget,
        "device_bytes_peak": st.device_bytes_peak, "kv_cache_bytes": st.kv_cache_bytes,
        "host_cache_bytes": st.host_cache_bytes, "layers_resident": st.layers_resident,
        "layers_streamed": st.layers_streamed, "bytes_streamed_per_pass": st.bytes_streamed_per_pass,
        "last_pass_time_s": st.last_pass_time_s, "decode_tokens_per_s": st.decode_tokens_per_s,
        "queue_depth": st.queue_depth, "active_sequences": st.active_sequences,
        "limiting_stage": st.limiting_stage, "stages": stages, "layers": layers,
        "passes": st.passes, "bytes_streamed_total": st.bytes_streamed_total,
        "host_bytes_budget": st.host_bytes_budget, "host_bytes_planned": st.host_bytes_planned,
        "host_bytes_peak": st.host_bytes_peak, "host_bytes_peak_source": st.host_bytes_peak_source,
        "numerics": st.numerics, "int_dots": st.int_dots, "kv_dtype": st.kv_dtype,
        "max_batch": st.max_batch, "max_context": st.max_context,
        "io_read_buffers": st.io_read_buffers, "io_read_buffers_free": st.io_read_buffers_free,
        "io_slots": st.io_slots, "io_slots_free": st.io_slots_free, "io_slots_pageable": st.io_slots_pageable,
        "io_units_failed": st.io_units_failed, "io_reads_stalled": st.io_reads_stalled,
        "io_short_reads": st.io_short_reads, "host_heap_in_use_bytes": st.host_heap_in_use_bytes,
        "expert_routing": st.expert_routing.iter().map(|r| serde_json::json!({"layer": r.layer, "tokens": r.tokens})).collect::<Vec<_>>(),
        "expert_streaming": st.expert_streaming.as_ref().map(expert_streaming_json),
        "speculative": st.speculative.as_ref().map(speculative_json),
        "prefix_cache": st.prefix_cache.as_ref().map(prefix_cache_json),
        "placement": st.placement.as_ref().map(placement_json),
    })
}

/// Where the layers run beside the device, in `sluice status --json`.
pub(crate) fn placement_json(x: &pb::Placement) -> serde_json::Value {
    serde_json::json!({
        "mode": x.mode,
        "cpu_layers": x.cpu_layers,
        "devices": x.devices.iter().map(|d| serde_json::json!({"device": d.device, "first_layer": d.first_layer, "layers": d.layers})).collect::<Vec<_>>(),
        "rows": x.rows,
        "predicted_pass_s": x.predicted_pass_s,
        "candidates": x.candidates.iter().map(|c| serde_json::json!({"cpu_layers": c.cpu_layers, "predicted_pass_s": c.predicted_pass_s})).collect::<Vec<_>>(),
        "changes": x.changes,
        "changes_failed": x.changes_failed,
        "last_change_s": x.last_change_s,
        "last_change_kv_bytes": x.last_change_kv_bytes,
    })
}

/// `sluice status`'s lines on layers placed beside the device, where any are.
pub(crate) fn print_placement(x: Option<&pb::Placement>) {
    let Some(x) = x.filter(|x| x.mode == "auto" || x.cpu_layers > 0 || !x.devices.is_empty())
    else {
        return;
    };
    let spans: Vec<String> = x
        .devices
        .iter()
        .map(|d| {
            format!(
                "; layers {}-{} on {}",
                d.first_layer,
                d.first_layer + d.layers.max(1) - 1,
                d.device
            )
        })
        .collect();
    println!(
        "placement        {}: {} layers on the host CPU{}",
        x.mode,
        x.cpu_layers,
        spans.concat()
    );
    if x.mode == "auto" {
        let all = x.candidates.iter().find(|c| c.cpu_layers == 0);
        println!(
            "  chosen for {} rows a pass: predicted {:.1} ms{}",
            x.rows,
            x.predicted_pass_s * 1e3,
            all.map_or(String::new(), |c| format!(
                " (all on the device {:.1} ms)",
                c.predicted_pass_s * 1e3
            ))
        );
        if x.changes + x.changes_failed > 0 {
            println!(
                "  following the batch: {} changes ({} given up), the last took {:.2} s and carried {:.1} MB of KV",
                x.changes,
                x.changes_failed,
                x.last_change_s,
                x.last_change_kv_bytes as f64 / 1e6
            );
        }
    }
}

/// The prefix cache's counts in `sluice status --json`.
pub(crate) fn prefix_cache_json(x: &pb::PrefixCache) -> serde_json::Value {
    serde_json::json!({
        "enabled": x.enabled,
        "kept_slots": x.kept_slots,
        "kept_tokens": x.kept_tokens,
        "kept_bytes": x.kept_bytes,
        "prompts": x.prompts,
        "hits": x.hits,
        "prompt_tokens": x.prompt_tokens,
        "cached_tokens": x.cached_tokens,
        "evictions": x.evictions,
        "host_budget_bytes": x.host_budget_bytes,
        "host_bytes": x.host_bytes,
        "host_blocks": x.host_blocks,
        "host_hits": x.host_hits,
        "host_tokens": x.host_tokens,
        "disk_enabled": x.disk_enabled,
        "disk_budget_bytes": x.disk_budget_bytes,
        "disk_bytes": x.disk_bytes,
        "disk_blocks": x.disk_blocks,
        "disk_hits": x.disk_hits,
        "disk_tokens": x.disk_tokens,
        "disk_write_errors": x.disk_write_errors,
        "disk_read_errors": x.disk_read_errors,
        "exported_blocks": x.exported_blocks,
    })
}

/// `sluice status`'s lines on placement, speculative decoding and the prefix cache.
pub(crate) fn print_engine_features(st: &pb::StatusResponse) {
    print_placement(st.placement.as_ref());
    print_speculative(st.speculative.as_ref());
    print_prefix_cache(st.prefix_cache.as_ref());
}

/// `sluice status`'s line on the prefix cache.
pub(crate) fn print_prefix_cache(x: Option<&pb::PrefixCache>) {
    let Some(x) = x else { return };
    if !x.enabled {
        println!("prefix cache     off");
        return;
    }
    println!(
        "prefix cache     {} of {} prompts reused KV; {} of {} prompt tokens not prefilled ({:.0} %); {} slots keep {} positions ({:.1} MiB)",
        x.hits,
        x.prompts,
        x.cached_tokens,
        x.prompt_tokens,
        100.0 * x.cached_tokens as f64 / x.prompt_tokens.max(1) as f64,
        x.kept_slots,
        x.kept_tokens,
        x.kept_bytes as f64 / (1 << 20) as f64
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rate = |h: u64| 100.0 * h as f64 / x.prompts.max(1) as f64;
    if x.host_budget_bytes > 0 {
        println!(
            "  host tier      {} blocks, {:.1} of {:.1} MiB; {} prompts ({:.0} %) took {} tokens from it",
            x.host_blocks,
            mib(x.host_bytes),
            mib(x.host_budget_bytes),
            x.host_hits,
            rate(x.host_hits),
            x.host_tokens
        );
    }
    if x.disk_enabled {
        println!(
            "  disk tier      {} blocks, {:.1} of {:.1} MiB; {} prompts ({:.0} %) read blocks from it for {} tokens; {} failed writes, {} damaged files",
            x.disk_blocks,
            mib(x.disk_bytes),
            mib(x.disk_budget_bytes),
            x.disk_hits,
            rate(x.disk_hits),
            x.disk_tokens,
            x.disk_write_errors,
            x.disk_read_errors
        );
    }
}

/// A mixture's streamed experts as `sluice status --json` shows them.
pub(crate) fn expert_streaming_json(x: &pb::ExpertStreaming) -> serde_json::Value {
    serde_json::json!({
        "routed": x.routed, "cache_hits": x.cache_hits, "loaded": x.loaded,
        "bytes_loaded": x.bytes_loaded, "predicted": x.predicted,
        "predicted_used": x.predicted_used, "prefetched": x.prefetched,
        "prefetched_unused": x.prefetched_unused, "cache_slots": x.cache_slots,
        "hot_slots": x.hot_slots,
    })
}

/// A layer's `n` most chosen experts and their shares, and how many experts served none.
pub(crate) fn hot_experts(tokens: &[u64], n: usize) -> String {
    let total: u64 = tokens.iter().sum();
    if total == 0 {
        return format!("no tokens yet ({} experts)", tokens.len());
    }
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    order.sort_by(|&a, &b| tokens[b].cmp(&tokens[a]).then(a.cmp(&b)));
    let top: Vec<String> = order
        .iter()
        .take(n)
        .map(|&e| format!("#{e} {:.1}%", 100.0 * tokens[e] as f64 / total as f64))
        .collect();
    let idle = tokens.iter().filter(|&&t| t == 0).count();
    format!("{}; {idle} of {} unused", top.join(", "), tokens.len())
}
