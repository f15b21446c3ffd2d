//! What forward passes did: time in compute, uploads and waits; bytes read, decoded and
//! uploaded; a mixture's experts routed, cached, loaded and predicted.

use serde::Serialize;

/// Statistics of forward passes (one pass, or summed).
#[derive(Clone, Debug, Default, Serialize)]
pub struct PassStats {
    pub passes: u64,
    pub pass_time_s: f64,
    /// Time in layer compute.
    pub compute_s: f64,
    /// The part of it in layers the host CPU computes beside the device
    /// (`Plan::cpu_layers`).
    pub host_compute_s: f64,
    /// Host time in upload calls (the copy itself for a synchronous backend).
    pub upload_s: f64,
    /// Device time of the copies (asynchronous backends; 0 otherwise): bytes_uploaded /
    /// copy_device_s is the copy stream's bandwidth while streaming.
    pub copy_device_s: f64,
    /// Time waiting for the I/O engine (disk read and decompression behind the compute).
    pub load_stall_s: f64,
    pub bytes_read: u64,
    pub bytes_decompressed: u64,
    /// Bytes copied to the device (a unified backend: lent in their staging slots).
    pub bytes_uploaded: u64,
    pub bytes_from_host_cache: u64,
    /// Upload parts copied before their unit had finished decompressing.
    pub partial_uploads: u64,
    /// Stored bytes a streamed embedding's lookup read (also in `bytes_read`).
    pub bytes_gathered: u64,
    /// Streamed layers of a mixture: the experts their steps routed to (each counted once
    /// per layer and step), those found in the expert cache, and those loaded (from disk
    /// or the host cache) with their raw bytes.
    pub experts_routed: u64,
    pub expert_cache_hits: u64,
    pub experts_loaded: u64,
    pub expert_bytes_loaded: u64,
    /// Experts predicted for a layer before it routed (those the step before chose there),
    /// and how many of them it then chose: precision = used / predicted, recall = used /
    /// routed.
    pub experts_predicted: u64,
    pub experts_predicted_used: u64,
    /// Predicted experts requested from disk before their layer routed, and how many of
    /// those loads went unused (cancelled or read in vain).
    pub expert_prefetches: u64,
    pub expert_prefetches_wasted: u64,
}

impl PassStats {
    /// Adds `o`'s counts and times to these.
    pub fn add(&mut self, o: &PassStats) {
        self.passes += o.passes;
        self.pass_time_s += o.pass_time_s;
        self.compute_s += o.compute_s;
        self.host_compute_s += o.host_compute_s;
        self.upload_s += o.upload_s;
        self.copy_device_s += o.copy_device_s;
        self.load_stall_s += o.load_stall_s;
        self.bytes_read += o.bytes_read;
        self.bytes_decompressed += o.bytes_decompressed;
        self.bytes_uploaded += o.bytes_uploaded;
        self.bytes_from_host_cache += o.bytes_from_host_cache;
        self.partial_uploads += o.partial_uploads;
        self.bytes_gathered += o.bytes_gathered;
        self.experts_routed += o.experts_routed;
        self.expert_cache_hits += o.expert_cache_hits;
        self.experts_loaded += o.experts_loaded;
        self.expert_bytes_loaded += o.expert_bytes_loaded;
        self.experts_predicted += o.experts_predicted;
        self.experts_predicted_used += o.experts_predicted_used;
        self.expert_prefetches += o.expert_prefetches;
        self.expert_prefetches_wasted += o.expert_prefetches_wasted;
    }
}
