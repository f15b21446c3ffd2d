//! The prefix cache's host tier, and the host and disk tiers together (`Tiers`): beyond
//! the KV slots (the device tier, `prefix.rs`), a prompt's KV is kept in blocks
//! (`kv_block`), in host memory within a budget and on disk (`kv_disk`).
//!
//! A block holds, per layer, whether that layer's K and V of its positions are in it: a
//! sliding-window layer's ring keeps only its last `cap` positions, so a block exported
//! from far behind the end of its sequence has no ring layers. A prefix is taken back only
//! where every ring layer has the blocks its window covers (`Tiers::resume_point`).

use super::kv_block::{chain, join_run, model_key, split_run, Block, BLOCK_TOKENS};
use super::kv_disk::{DiskStats, DiskTier};
use super::sequence::Sequence;
use crate::backend::{Backend, LayerCache};
use crate::pipeline::Pipeline;
use crate::plan::KV_EXPORT_RUN_BYTES;
use crate::store::format::MANIFEST_FILE;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

/// The host tier: blocks in host memory within a budget, the least recently used given up
/// first.
pub struct HostTier {
    budget: u64,
    used: u64,
    clock: u64,
    blocks: HashMap<u64, (Arc<Block>, u64)>,
    /// Last use -> block name.
    order: BTreeMap<u64, u64>,
}

impl HostTier {
    pub fn new(budget: u64) -> HostTier {
        HostTier {
            budget,
            used: 0,
            clock: 0,
            blocks: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The block named `hash`, without touching its place in the order.
    pub fn peek(&self, hash: u64) -> Option<&Arc<Block>> {
        self.blocks.get(&hash).map(|(b, _)| b)
    }

    /// The block named `hash`, now the most recently used.
    pub fn get(&mut self, hash: u64) -> Option<Arc<Block>> {
        self.clock += 1;
        let (b, at) = self.blocks.get_mut(&hash)?;
        self.order.remove(at);
        *at = self.clock;
        self.order.insert(self.clock, hash);
        Some(b.clone())
    }

    /// Keeps `block` as `hash` (replacing what it held), giving up the least recently used
    /// until it fits; a block larger than the whole budget is not kept. Returns the blocks
    /// given up.
    pub fn insert(&mut self, hash: u64, block: Arc<Block>) -> usize {
        self.remove(hash);
        let size = block.size();
        if size > self.budget {
            return 0;
        }
        let mut evicted = 0;
        while self.used + size > self.budget {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some((b, _)) = self.blocks.remove(&oldest) {
                self.used -= b.size();
                evicted += 1;
            }
        }
        self.clock += 1;
        self.used += size;
        self.order.insert(self.clock, hash);
        self.blocks.insert(hash, (block, self.clock));
        evicted
    }

    /// A new budget (the plan of another placement leaves another room): the least
    /// recently used blocks are given up until the tier fits it. Returns those given up.
    pub fn set_budget(&mut self, budget: u64) -> usize {
        self.budget = budget;
        let mut evicted = 0;
        while self.used > self.budget {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some((b, _)) = self.blocks.remove(&oldest) {
                self.used -= b.size();
                evicted += 1;
            }
        }
        evicted
    }

    pub fn remove(&mut self, hash: u64) {
        if let Some((b, at)) = self.blocks.remove(&hash) {
            self.order.remove(&at);
            self.used -= b.size();
        }
    }

    /// Gives up every block; returns how many.
    pub fn clear(&mut self) -> usize {
        let n = self.blocks.len();
        self.blocks.clear();
        self.order.clear();
        self.used = 0;
        n
    }
}

/// The tiers' sizes (`--kv-cache-host`, and the disk tier `--kv-cache-dir` opened).
#[derive(Clone, Debug, Default)]
pub struct TierConfig {
    /// Host memory for blocks (0: no host tier).
    pub host_bytes: u64,
    pub disk: Option<Arc<DiskTier>>,
}

/// What the host and disk tiers hold and gave (Status, /metrics).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TierStats {
    pub host_budget_bytes: u64,
    pub host_bytes: u64,
    pub host_blocks: u64,
    /// Prompts that took a prefix from the tiers with every block in host memory, those
    /// that read some from disk, and the prompt tokens each gave.
    pub host_hits: u64,
    pub host_tokens: u64,
    pub disk_hits: u64,
    pub disk_tokens: u64,
    /// Blocks copied out of the KV slots.
    pub exported_blocks: u64,
    pub disk_enabled: bool,
    pub disk: DiskStats,
}

/// The host and disk tiers of one model's prefix cache.
pub struct Tiers {
    key: u64,
    host: HostTier,
    disk: Option<Arc<DiskTier>>,
    layers: Vec<LayerCache>,
    /// Bytes of a block with every layer.
    block_bytes: usize,
    stats: TierStats,
}

/// A block found for a prompt, and whether it was read from disk.
struct Found {
    block: Arc<Block>,
    from_disk: bool,
}

/// Per layer, whether a slot that has written up to `written` still holds all of
/// `positions` (a ring holds its last `cap`).
fn held_layers(layers: &[LayerCache], positions: &Range<usize>, written: usize) -> Vec<bool> {
    layers
        .iter()
        .map(|l| positions.start >= written.saturating_sub(l.cap))
        .collect()
}

impl Tiers {
    /// The tiers of `runner`'s model, or None when `cfg` has neither (or the store's
    /// manifest, which names the blocks, cannot be read: logged).
    pub fn new<B: Backend>(runner: &Pipeline<B>, cfg: &TierConfig) -> Option<Tiers> {
        if cfg.host_bytes == 0 && cfg.disk.is_none() {
            return None;
        }
        let path = runner.store.dir().join(MANIFEST_FILE);
        let manifest = match std::fs::read(&path) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(
                    "prefix cache: {} unreadable ({e}): no host or disk tier for this model",
                    path.display()
                );
                return None;
            }
        };
        let m = &runner.model;
        // Every part's layers (the host's, this device's, the others'), as blocks hold
        // them: a block is the same whatever the placement.
        let layers: Vec<LayerCache> = runner.kv_layers();
        let o = runner.options();
        let key = model_key(
            &manifest,
            (o.kv_dtype, o.exact),
            runner.backend.name(),
            &layers,
            m.kv_position_bytes(),
        );
        Some(Tiers {
            key,
            host: HostTier::new(cfg.host_bytes),
            disk: cfg.disk.clone(),
            block_bytes: layers.len() * BLOCK_TOKENS * m.kv_position_bytes(),
            layers,
            stats: TierStats::default(),
        })
    }

    /// The host tier's budget, another placement's (`HostTier::set_budget`).
    pub fn set_host_budget(&mut self, budget: u64) -> usize {
        self.host.set_budget(budget)
    }

    /// The key this model's blocks are named under.
    pub fn key(&self) -> u64 {
        self.key
    }

    pub fn stats(&self) -> TierStats {
        let mut s = self.stats;
        s.host_budget_bytes = self.host.budget();
        s.host_bytes = self.host.bytes();
        s.host_blocks = self.host.len() as u64;
        s.disk_enabled = self.disk.is_some();
        if let Some(d) = &self.disk {
            s.disk = d.stats();
        }
        s
    }

    /// Gives up the host tier's blocks and this model's on disk; returns how many.
    pub fn clear(&mut self) -> usize {
        self.host.clear() + self.disk.as_ref().map_or(0, |d| d.clear(Some(self.key)))
    }

    /// Keeps the whole blocks of `tokens`, whose K and V `slot` holds (having written up
    /// to `written`), that the tiers lack: copied to the host tier, and queued for the disk
    /// tier. A block already kept is only touched, or replaced where this copy holds
    /// layers (a ring's) that it lacks.
    pub fn export<B: Backend>(
        &mut self,
        runner: &Pipeline<B>,
        tokens: &[u32],
        slot: usize,
        written: usize,
    ) {
        let n = tokens.len() / BLOCK_TOKENS;
        let names = chain(self.key, tokens, n);
        // The blocks to copy out: (index, layers held); and per block whether the disk
        // tier wants it.
        let mut todo: Vec<(usize, Vec<bool>)> = Vec::new();
        let mut to_disk = vec![false; n];
        for (i, &h) in names.iter().enumerate() {
            let positions = i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS;
            let held = held_layers(&self.layers, &positions, written);
            let full = held.iter().all(|&h| h);
            to_disk[i] = self
                .disk
                .as_ref()
                .is_some_and(|d| match d.has(self.key, h) {
                    Some(f) => !f && full,
                    None => true,
                });
            // Copied out where a tier will keep it: the host tier lacks it (and has room
            // for blocks at all), or the disk tier wants it.
            let lacking = self.host.get(h).is_none_or(|b| !b.covers(&held));
            if lacking && (self.host.budget() > 0 || to_disk[i]) {
                todo.push((i, held));
            }
        }
        // Consecutive blocks holding the same layers are copied out together: one copy a
        // layer for the run, not one a block (each a synchronous transfer on a device).
        let mut copied: HashMap<usize, Arc<Block>> = HashMap::new();
        let mut at = 0;
        while at < todo.len() {
            // At most KV_EXPORT_RUN_BYTES at once (the plan counts it, and the blocks
            // made of it, beside the host tier).
            let run_max = (KV_EXPORT_RUN_BYTES as usize / self.block_bytes.max(1)).max(1);
            let mut end = at + 1;
            while end < todo.len()
                && end - at < run_max
                && todo[end].0 == todo[end - 1].0 + 1
                && todo[end].1 == todo[at].1
            {
                end += 1;
            }
            let (first, count) = (todo[at].0, end - at);
            let positions = first * BLOCK_TOKENS..(first + count) * BLOCK_TOKENS;
            let (held, bytes) = runner.export_kv(slot, positions, written);
            let layers = held.iter().filter(|&&h| h).count();
            for (j, bytes) in split_run(&bytes, count, layers).into_iter().enumerate() {
                let i = first + j;
                let block = Arc::new(Block {
                    parent: if i == 0 { self.key } else { names[i - 1] },
                    tokens: tokens[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS].to_vec(),
                    held: held.clone(),
                    bytes,
                });
                self.stats.exported_blocks += 1;
                self.host.insert(names[i], block.clone());
                copied.insert(i, block);
            }
            at = end;
        }
        let Some(d) = &self.disk else { return };
        for (i, &h) in names.iter().enumerate().filter(|&(i, _)| to_disk[i]) {
            let block = copied
                .get(&i)
                .cloned()
                .or_else(|| self.host.peek(h).cloned());
            if let Some(b) = block {
                d.write(self.key, h, b);
            }
        }
    }

    /// The blocks named `hashes` (a prompt's, in order) that the tiers hold and that are
    /// what they say (tokens and parent), up to the first that is missing or not; the disk's
    /// are read at once and kept in the host tier too.
    fn gather(&mut self, prompt: &[u32], hashes: &[u64]) -> Vec<Found> {
        let on_disk: Vec<u64> = hashes
            .iter()
            .copied()
            .filter(|&h| self.host.peek(h).is_none())
            .collect();
        let read = match &self.disk {
            Some(d) if !on_disk.is_empty() => d.read(self.key, &on_disk),
            _ => Vec::new(),
        };
        // By name: a block the host tier held may be given up below, as the disk's come
        // in; it is then a miss, not another block's bytes.
        let mut read: HashMap<u64, Result<Block, String>> = on_disk.into_iter().zip(read).collect();
        let mut found = Vec::with_capacity(hashes.len());
        let mut parent = self.key;
        for (i, &h) in hashes.iter().enumerate() {
            let f = match self.host.get(h) {
                Some(block) => Found {
                    block,
                    from_disk: false,
                },
                None => match read.remove(&h) {
                    Some(Ok(b)) => {
                        let block = Arc::new(b);
                        self.host.insert(h, block.clone());
                        Found {
                            block,
                            from_disk: true,
                        }
                    }
                    _ => break,
                },
            };
            let tokens = &prompt[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS];
            if !f.block.is_of(parent, tokens) || f.block.held.len() != self.layers.len() {
                tracing::warn!(
                    "prefix cache: block {h:016x} holds another text than its name says (a hash collision): not used"
                );
                self.host.remove(h);
                break;
            }
            found.push(f);
            parent = h;
        }
        found
    }

    /// Where a sequence can resume from `blocks` (a prompt's first blocks, in order): the
    /// most blocks k, at least one past `beat`, such that each layer holds every block from
    /// the one its first visible position at k blocks is in (a full-attention layer: all of
    /// them; a ring: its window). Returns k, the positions its slot counts as written once
    /// they are in (so that a ring's held positions are the ones written back: see
    /// `LayerCache::held_runs`), and per layer the first block written back.
    fn resume_point<B: Backend>(
        &self,
        runner: &Pipeline<B>,
        blocks: &[Found],
        beat: usize,
    ) -> Option<(usize, usize, Vec<usize>)> {
        (1..=blocks.len())
            .rev()
            .take_while(|&k| k * BLOCK_TOKENS >= beat + BLOCK_TOKENS)
            .find_map(|k| {
                let p = k * BLOCK_TOKENS;
                let first: Vec<usize> = self
                    .layers
                    .iter()
                    .map(|l| l.first_visible(p) / BLOCK_TOKENS)
                    .collect();
                let whole = self
                    .layers
                    .iter()
                    .enumerate()
                    .all(|(l, _)| blocks[first[l]..k].iter().all(|b| b.block.held[l]));
                let written = self
                    .layers
                    .iter()
                    .zip(&first)
                    .filter(|(l, _)| l.window.is_some())
                    .map(|(l, &f)| f * BLOCK_TOKENS + l.cap)
                    .fold(p, usize::max);
                (whole && runner.can_resume(p, written)).then_some((k, written, first))
            })
    }

    /// Takes the longest prefix of `seq`'s prompt the tiers hold, when it is at least a
    /// block past `beat` (what its slot holds or the device tier gives it): its blocks are
    /// written into the sequence's slot and it resumes after them. Returns the prompt
    /// tokens taken (0: none).
    pub fn take<B: Backend>(
        &mut self,
        runner: &mut Pipeline<B>,
        seq: &mut Sequence,
        beat: usize,
    ) -> usize {
        let prompt = seq.prompt();
        // The last prompt token always runs (its logits give the first token).
        let n = prompt.len().saturating_sub(1) / BLOCK_TOKENS;
        if n * BLOCK_TOKENS < beat + BLOCK_TOKENS {
            return 0;
        }
        let hashes = chain(self.key, prompt, n);
        let avail = hashes
            .iter()
            .take_while(|&&h| {
                self.host.peek(h).is_some()
                    || self
                        .disk
                        .as_ref()
                        .is_some_and(|d| d.has(self.key, h).is_some())
            })
            .count();
        if avail * BLOCK_TOKENS < beat + BLOCK_TOKENS {
            return 0;
        }
        let blocks = self.gather(prompt, &hashes[..avail]);
        let Some((k, written, first)) = self.resume_point(runner, &blocks, beat) else {
            return 0;
        };
        // Consecutive blocks with the same layers held and wanted go back together.
        let slot = seq.slot();
        let want = |i: usize| -> Vec<bool> { first.iter().map(|&b| i >= b).collect() };
        let run_max = (KV_EXPORT_RUN_BYTES as usize / self.block_bytes.max(1)).max(1);
        let mut at = 0;
        while at < k {
            let (held, wanted) = (&blocks[at].block.held, want(at));
            let mut end = at + 1;
            while end < k
                && end - at < run_max
                && blocks[end].block.held == *held
                && want(end) == wanted
            {
                end += 1;
            }
            let parts: Vec<&[u8]> = blocks[at..end].iter().map(|f| &f.block.bytes[..]).collect();
            let bytes = join_run(&parts, held.iter().filter(|&&h| h).count());
            let positions = at * BLOCK_TOKENS..end * BLOCK_TOKENS;
            if let Err(e) = runner.import_kv(slot, positions, (held, &bytes), &wanted) {
                tracing::warn!("prefix cache: blocks {at}..{end} of a prompt not taken back: {e}");
                return 0;
            }
            at = end;
        }
        let p = k * BLOCK_TOKENS;
        let gained = p - seq.prefilled();
        if blocks[..k].iter().any(|f| f.from_disk) {
            self.stats.disk_hits += 1;
            self.stats.disk_tokens += gained as u64;
        } else {
            self.stats.host_hits += 1;
            self.stats.host_tokens += gained as u64;
        }
        seq.resume_at(p, written);
        gained
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv_block::test_block as block;

    #[test]
    fn the_host_tier_keeps_its_budget_and_gives_up_the_least_recent() {
        let size = block(0, 2).size();
        let mut h = HostTier::new(3 * size);
        for i in 0..3 {
            h.insert(i, Arc::new(block(i as u8, 2)));
        }
        assert!(h.get(0).is_some());
        assert_eq!(h.insert(3, Arc::new(block(3, 2))), 1);
        assert!(h.peek(1).is_none(), "1 was the least recently used");
        assert!(h.peek(0).is_some() && h.peek(3).is_some());
        assert_eq!(h.bytes(), 3 * size);
        h.insert(0, Arc::new(block(9, 2)));
        assert_eq!(
            (h.len(), h.bytes()),
            (3, 3 * size),
            "a replaced block is counted once"
        );
        assert_eq!(HostTier::new(size - 1).insert(0, Arc::new(block(0, 2))), 0);
        // Another placement's plan leaves the tier less room: the least recent go.
        assert!(h.get(2).is_some());
        assert_eq!(h.set_budget(size + size / 2), 2);
        assert_eq!((h.len(), h.bytes(), h.budget()), (1, size, size + size / 2));
        assert!(h.peek(2).is_some(), "2 was the most recently used");
        assert_eq!(h.set_budget(4 * size), 0);
        assert_eq!(h.clear(), 1);
        assert_eq!(h.bytes(), 0);
    }
}
