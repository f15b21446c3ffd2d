//! Attention on the CPU (`Backend::attention`): over an f16 cache, a KV head at a time,
//! each key and value converted once for the query heads that share it and a row's keys
//! in chunks whose softmax partials merge in chunk order (`attention_grouped`); over an
//! f32 cache (`--exact`), a KV head at a time with every number the bits of the
//! head-at-a-time path (`attention_grouped_f32`); else a (span, head) a task (`KvRows`).
//! Decode rows with few tasks split across the team with the same bits. The kernels they
//! run are in `kernels.rs`.

pub mod kernels;
#[cfg(test)]
mod tests;

use crate::backend::cpu::elementwise::{exp_f32, map1};
use crate::backend::cpu::{f32_vector, CpuBackend, CpuMem, Scratch, SharedPtr};
use crate::backend::cpu::{KEYS, PARTIAL, SCORES};
use crate::backend::{AttnShape, AttnStep, KvDtype, SeqSpan, WeightRef};
use kernels::GROUP_MAX;

/// The KV cache's rows, whatever its element type: q . k and o += w v.
enum KvRows<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [u16], &'a [u16]),
}

impl<'a> KvRows<'a> {
    fn of(kv: KvDtype, k: &'a CpuMem, v: &'a CpuMem) -> KvRows<'a> {
        match kv {
            KvDtype::F32 => KvRows::F32(k.f32s(), v.f32s()),
            KvDtype::F16 => KvRows::F16(k.u16s(), v.u16s()),
        }
    }

    /// q . (key row at `at`), in an order that depends only on the head dimension.
    fn dot(&self, at: usize, q: &[f32]) -> f32 {
        let n = q.len();
        match self {
            KvRows::F32(ks, _) => kernels::dot_f32(q, &ks[at..at + n]),
            KvRows::F16(ks, _) => kernels::dot_f16(q, &ks[at..at + n]),
        }
    }

    /// Scores of keys lo..lo + sc.len() against q, `row(j)` the element of key j: four at a
    /// time from lo (the grouping depends only on lo and the count, not on the batch;
    /// each score's bits are `dot`'s).
    fn scores(&self, q: &[f32], lo: usize, row: impl Fn(usize) -> usize, sc: &mut [f32]) {
        let mut j = 0;
        while j + 4 <= sc.len() {
            let at = std::array::from_fn(|r| row(lo + j + r));
            let four = match self {
                KvRows::F32(ks, _) => kernels::dot4_f32(q, ks, at),
                KvRows::F16(ks, _) => kernels::dot4_f16(q, ks, at),
            };
            sc[j..j + 4].copy_from_slice(&four);
            j += 4;
        }
        for (i, s) in sc.iter_mut().enumerate().skip(j) {
            *s = self.dot(row(lo + i), q);
        }
    }

    /// o += w[j] (value row of key lo + j) for every j, in order.
    fn weighted_sum(&self, w: &[f32], lo: usize, row: impl Fn(usize) -> usize, o: &mut [f32]) {
        let mut j = 0;
        while j + 4 <= w.len() {
            let at = std::array::from_fn(|r| row(lo + j + r));
            let four = std::array::from_fn(|r| w[j + r]);
            match self {
                KvRows::F32(_, vs) => kernels::axpy4_f32(four, vs, at, o),
                KvRows::F16(_, vs) => kernels::axpy4_f16(four, vs, at, o),
            }
            j += 4;
        }
        for (i, &wi) in w.iter().enumerate().skip(j) {
            self.axpy(row(lo + i), wi, o);
        }
    }

    /// o += w (value row at `at`).
    fn axpy(&self, at: usize, w: f32, o: &mut [f32]) {
        let n = o.len();
        match self {
            KvRows::F32(_, vs) => kernels::axpy_f32(w, &vs[at..at + n], o),
            KvRows::F16(_, vs) => kernels::axpy_f16(w, &vs[at..at + n], o),
        }
    }
}

impl CpuBackend {
    /// `Backend::attention`: the grouped kernels where they apply (an f16 cache with AVX2,
    /// an f32 cache with heads a multiple of 8 wide), else a (span, head) a task, its keys
    /// four at a time (`KvRows`).
    pub(super) fn attend(
        &self,
        q: &CpuMem,
        cache_k: &CpuMem,
        cache_v: &CpuMem,
        step: &AttnStep<'_>,
        sinks: Option<WeightRef<'_, CpuMem>>,
        out: &mut CpuMem,
    ) {
        // The decoder stores sinks in f32 (read in place); another dtype is converted.
        let mut converted = Vec::new();
        let sinks = sinks.map(|w| f32_vector(&w, &mut converted));
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            max_context,
            scale,
            ..
        } = shape;
        let group = heads / kv_heads;
        let width_q = heads * head_dim;
        let qs = q.f32s();
        let kv = KvRows::of(shape.kv, cache_k, cache_v);
        let optr = SharedPtr(out.f32s_mut().as_mut_ptr());
        let mut scratch = self.scratch();
        let tasks = &mut scratch.tasks;
        tasks.clear();
        if let (KvRows::F16(ks, vs), true) = (&kv, kernels::has_group_f16(head_dim)) {
            drop(scratch);
            return self.attention_grouped(qs, (ks, vs), step, sinks, optr);
        }
        if let (KvRows::F32(ks, vs), true) = (&kv, head_dim.is_multiple_of(8)) {
            drop(scratch);
            return self.attention_grouped_f32(qs, (ks, vs), step, sinks, optr);
        }
        tasks.extend((0..spans.len()).flat_map(|i| (0..heads).map(move |h| (i, h))));
        let tasks = &*tasks;
        self.run(|par| {
            par.for_each_in(tasks, |&(si, h)| {
                let sp = spans[si];
                let g = h / group;
                SCORES.with(|sc| {
                    let mut sc = sc.borrow_mut();
                    // Room for the whole context once, not a doubling as positions grow.
                    let len = sc.len();
                    sc.reserve(max_context.saturating_sub(len));
                    for t in 0..sp.n {
                        // Attends to positions lo..=p (all of them, or its window).
                        let rk = step.row_keys(&sp, t);
                        let p = rk.pos;
                        let lo = cache.first_visible(p);
                        let kv_row = |j: usize| cache.at(&shape, sp.slot, rk.key(j)) + g * head_dim;
                        let qrow = &qs[(sp.row + t) * width_q + h * head_dim..][..head_dim];
                        sc.resize(p + 1 - lo, 0.0);
                        kv.scores(qrow, lo, kv_row, &mut sc);
                        softmax_scaled(&mut sc, scale, sinks.map(|s| s[h]));
                        // SAFETY: task (span, head) writes its own head's columns of its own
                        // rows; no two tasks share a (row, head).
                        let o =
                            unsafe { optr.slice((sp.row + t) * width_q + h * head_dim, head_dim) };
                        o.fill(0.0);
                        kv.weighted_sum(&sc, lo, kv_row, o);
                    }
                });
            });
        });
    }

    /// Attention over an f32 cache (`--exact`), a KV head at a time: each key and value is
    /// read once for the query heads that share it (up to GROUP_MAX at once), a row's
    /// scores over its whole visible context, then its softmax, then the weighted values,
    /// in chunks of ATTN_CHUNK keys. A task is a (span, KV head); when those are fewer
    /// than two a thread, a decode row's scores are computed a chunk of keys a task, then
    /// its weighted values a block of columns a task (each softmaxing the row again), so a
    /// long context keeps every thread busy. Every number has the bits of the
    /// head-at-a-time path (`KvRows::scores`, `softmax_scaled`, `KvRows::weighted_sum`):
    /// the same products and sums in the same order, however the work is cut.
    fn attention_grouped_f32(
        &self,
        qs: &[f32],
        (ks, vs): (&[f32], &[f32]),
        step: &AttnStep<'_>,
        sinks: Option<&[f32]>,
        optr: SharedPtr,
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (group, width_q, scale) = (heads / kv_heads, heads * hd, shape.scale);
        let split = self.threads > 1 && spans.len() * kv_heads < 2 * self.threads;
        // A chunk's scores for the group's heads, rows ATTN_CHUNK apart.
        let block = group * ATTN_CHUNK;
        // Positions a query at p sees.
        let visible = |p: usize| p + 1 - cache.first_visible(p);
        let mut scratch = self.scratch();
        let Scratch {
            attn_tasks,
            partials,
            ..
        } = &mut *scratch;
        // (span, KV head, chunk or ALL of them, where a chunk's scores go).
        let chunks_of = |sp: &SeqSpan| visible(sp.pos).div_ceil(ATTN_CHUNK);
        let at = attention_tasks(attn_tasks, (spans, kv_heads), split, chunks_of, block);
        partials.clear();
        partials.resize(at, 0.0);
        let pptr = SharedPtr(partials.as_mut_ptr());
        let tasks = &*attn_tasks;
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, c, at)| {
                let sp = spans[si];
                KEYS.with(|keys| {
                    let mut keys = keys.borrow_mut();
                    if c != ALL {
                        // SAFETY: this task's own block of the partials.
                        let out = unsafe { pptr.slice(at, block) };
                        chunk_keys(&mut keys, step, &sp, 0, g, c);
                        let qg = &qs[sp.row * width_q + g * group * hd..][..group * hd];
                        kernels::group_scores_f32(qg, hd, ks, &keys, out, ATTN_CHUNK);
                        return;
                    }
                    SCORES.with(|sc| {
                        let mut sc = sc.borrow_mut();
                        for t in 0..sp.n {
                            let len = visible(step.row_keys(&sp, t).pos);
                            let row = (sp.row + t) * width_q;
                            let n_chunks = len.div_ceil(ATTN_CHUNK);
                            for (h0, gh) in head_subgroups(g, group) {
                                let qg = &qs[row + h0 * hd..][..gh * hd];
                                sc.resize(gh * len, 0.0);
                                for c in 0..n_chunks {
                                    chunk_keys(&mut keys, step, &sp, t, g, c);
                                    let out = &mut sc[c * ATTN_CHUNK..];
                                    kernels::group_scores_f32(qg, hd, ks, &keys, out, len);
                                }
                                for (i, row_sc) in sc.chunks_exact_mut(len).enumerate() {
                                    softmax_scaled(row_sc, scale, sinks.map(|s| s[h0 + i]));
                                }
                                // SAFETY: task (span, KV head) writes the columns of its own
                                // query heads in its own rows; no two tasks share one.
                                let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                                o.fill(0.0);
                                for c in 0..n_chunks {
                                    chunk_keys(&mut keys, step, &sp, t, g, c);
                                    let w = &sc[c * ATTN_CHUNK..];
                                    kernels::group_pv_f32(w, len, hd, vs, &keys, o);
                                }
                            }
                        }
                    })
                });
            });
        });
        if at == 0 {
            return;
        }
        self.split_rows_values_f32(vs, step, sinks, optr, (attn_tasks, partials));
    }

    /// `attention_grouped_f32`'s split decode rows, once their scores are in `partials` (a
    /// block of `group * ATTN_CHUNK` a chunk, from each task's offset in `attn_tasks`):
    /// their weighted values, a block of columns a task, each softmaxing its row again.
    fn split_rows_values_f32(
        &self,
        vs: &[f32],
        step: &AttnStep<'_>,
        sinks: Option<&[f32]>,
        optr: SharedPtr,
        (attn_tasks, partials): (&mut Vec<Task>, &[f32]),
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (group, width_q, scale) = (heads / kv_heads, heads * hd, shape.scale);
        // A split row's columns in blocks of `width` (a multiple of 8), enough blocks for
        // two tasks a thread.
        let blocks = (2 * self.threads).div_ceil((spans.len() * kv_heads).max(1));
        let width = hd.div_ceil(blocks).next_multiple_of(8).min(hd);
        // A chunk's scores for the group's heads, rows ATTN_CHUNK apart.
        let block = group * ATTN_CHUNK;
        // Positions a query at p sees.
        let visible = |p: usize| p + 1 - cache.first_visible(p);
        // The split rows' weighted values: (span, KV head, column block, its scores).
        let n = attn_tasks.len();
        for i in 0..n {
            let (si, g, c, at) = attn_tasks[i];
            if c == 0 {
                attn_tasks.extend((0..hd.div_ceil(width)).map(|b| (si, g, b, at)));
            }
        }
        attn_tasks.drain(..n);
        let tasks = &*attn_tasks;
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, b, at)| {
                let sp = spans[si];
                let len = visible(sp.pos);
                let (row, c0) = (sp.row * width_q, b * width);
                let w = width.min(hd - c0);
                SCORES.with(|sc| {
                    KEYS.with(|keys| {
                        PARTIAL.with(|part| {
                            let (mut sc, mut keys) = (sc.borrow_mut(), keys.borrow_mut());
                            let mut part = part.borrow_mut();
                            for (h0, gh) in head_subgroups(g, group) {
                                sc.resize(gh * len, 0.0);
                                for (i, row_sc) in sc.chunks_exact_mut(len).enumerate() {
                                    let hr = h0 - g * group + i;
                                    for (c, piece) in row_sc.chunks_mut(ATTN_CHUNK).enumerate() {
                                        let from = at + c * block + hr * ATTN_CHUNK;
                                        piece.copy_from_slice(&partials[from..from + piece.len()]);
                                    }
                                    softmax_scaled(row_sc, scale, sinks.map(|s| s[h0 + i]));
                                }
                                part.clear();
                                part.resize(gh * w, 0.0);
                                for c in 0..len.div_ceil(ATTN_CHUNK) {
                                    chunk_keys(&mut keys, step, &sp, 0, g, c);
                                    let p = &sc[c * ATTN_CHUNK..];
                                    kernels::group_pv_f32(p, len, w, &vs[c0..], &keys, &mut part);
                                }
                                for (i, o) in part.chunks_exact(w).enumerate() {
                                    // SAFETY: task (span, KV head, block) writes its own
                                    // columns of its own query heads in its own row.
                                    let dst = unsafe { optr.slice(row + (h0 + i) * hd + c0, w) };
                                    dst.copy_from_slice(o);
                                }
                            }
                        })
                    })
                });
            });
        });
    }

    /// Attention over an f16 cache, a KV head at a time: each key and value is converted
    /// once for the query heads that share it (up to GROUP_MAX at once), and a row's keys
    /// go in chunks of ATTN_CHUNK from its first visible position, each chunk's softmax
    /// partial merged into the row's in chunk order (`chunk_partial`, `merge_partial`).
    /// A task is a (span, KV head); when those are fewer than two a thread, the chunks of
    /// single-token spans (decode rows) become tasks of their own and merge after, so one
    /// sequence's long context keeps every thread busy. Either way a row's numbers are the
    /// same: the same partials merged in the same order.
    fn attention_grouped(
        &self,
        qs: &[f32],
        (ks, vs): (&[u16], &[u16]),
        step: &AttnStep<'_>,
        sinks: Option<&[f32]>,
        optr: SharedPtr,
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (group, width_q, scale) = (heads / kv_heads, heads * hd, shape.scale);
        let rec = group * (2 + hd);
        let chunks_of = |sp: &SeqSpan| {
            let p = sp.pos + sp.n - 1;
            (p + 1 - cache.first_visible(p)).div_ceil(ATTN_CHUNK)
        };
        let split = self.threads > 1 && spans.len() * kv_heads < 2 * self.threads;
        let mut scratch = self.scratch();
        let Scratch {
            attn_tasks,
            partials,
            ..
        } = &mut *scratch;
        // (span, KV head, chunk or ALL of them in order, where its partial goes).
        let at = attention_tasks(attn_tasks, (spans, kv_heads), split, chunks_of, rec);
        partials.clear();
        partials.resize(at, 0.0);
        let pptr = SharedPtr(partials.as_mut_ptr());
        let tasks = &*attn_tasks;
        let subgroups = |g: usize| head_subgroups(g, group);
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, c, at)| {
                let sp = spans[si];
                SCORES.with(|sc| {
                    KEYS.with(|keys| {
                        PARTIAL.with(|part| {
                            let (mut sc, mut keys) = (sc.borrow_mut(), keys.borrow_mut());
                            let mut part = part.borrow_mut();
                            part.resize(2 * rec, 0.0);
                            let (acc, cur) = part.split_at_mut(rec);
                            if c != ALL {
                                // SAFETY: this task's own record of the partials.
                                let out = unsafe { pptr.slice(at, rec) };
                                chunk_keys(&mut keys, step, &sp, 0, g, c);
                                for (h0, gh) in subgroups(g) {
                                    let qg = &qs[sp.row * width_q + h0 * hd..][..gh * hd];
                                    let r =
                                        &mut out[(h0 - g * group) * (2 + hd)..][..gh * (2 + hd)];
                                    chunk_partial(qg, hd, (ks, vs), &keys, scale, &mut sc, r);
                                }
                                return;
                            }
                            for t in 0..sp.n {
                                let p = step.row_keys(&sp, t).pos;
                                let n_chunks =
                                    (p + 1 - cache.first_visible(p)).div_ceil(ATTN_CHUNK);
                                let row = (sp.row + t) * width_q;
                                for (h0, gh) in subgroups(g) {
                                    let qg = &qs[row + h0 * hd..][..gh * hd];
                                    let w = gh * (2 + hd);
                                    for c in 0..n_chunks {
                                        chunk_keys(&mut keys, step, &sp, t, g, c);
                                        let r = if c == 0 { &mut acc[..w] } else { &mut cur[..w] };
                                        chunk_partial(qg, hd, (ks, vs), &keys, scale, &mut sc, r);
                                        if c > 0 {
                                            merge_partial(&mut acc[..w], &cur[..w], gh, hd);
                                        }
                                    }
                                    // SAFETY: task (span, KV head) writes the columns of its
                                    // own query heads in its own rows; no two tasks share one.
                                    let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                                    let sk = sinks.map(|s| &s[h0..h0 + gh]);
                                    finish_partial(&acc[..w], gh, hd, sk, o);
                                }
                            }
                        })
                    })
                });
            });
        });
        // The split rows: their chunks' partials merged in chunk order.
        merge_split_rows(tasks, step, partials, chunks_of, sinks, optr);
    }
}

/// A grouped attention's task for all of a (span, KV head)'s chunks of keys.
const ALL: usize = usize::MAX;

/// A grouped attention's task: (span, KV head, chunk or ALL, where its results go).
type Task = (usize, usize, usize, usize);

/// The tasks of a grouped attention into `tasks`: (span, KV head, ALL, 0) for each, or
/// where `split`, for a span of one row (a decode row), a task per chunk of its keys
/// (`chunks_of`): (span, KV head, chunk, where its `rec` floats of results go). Returns
/// the floats the chunks' results take.
fn attention_tasks(
    tasks: &mut Vec<Task>,
    (spans, kv_heads): (&[SeqSpan], usize),
    split: bool,
    chunks_of: impl Fn(&SeqSpan) -> usize,
    rec: usize,
) -> usize {
    tasks.clear();
    let mut at = 0;
    for (si, sp) in spans.iter().enumerate() {
        for g in 0..kv_heads {
            if split && sp.n == 1 {
                for c in 0..chunks_of(sp) {
                    tasks.push((si, g, c, at));
                    at += rec;
                }
            } else {
                tasks.push((si, g, ALL, 0));
            }
        }
    }
    at
}

/// The query heads of KV head `g` (`group` of them) in runs of at most GROUP_MAX: (first
/// head, count).
fn head_subgroups(g: usize, group: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
    (g * group..(g + 1) * group)
        .step_by(GROUP_MAX)
        .map(move |h0| (h0, ((g + 1) * group - h0).min(GROUP_MAX)))
}

/// Keys a chunk of grouped f16 attention (`CpuBackend::attention_grouped`).
pub(super) const ATTN_CHUNK: usize = 256;

/// The cache offsets of KV head `g`'s keys in chunk `c` (of ATTN_CHUNK) of the keys row `t`
/// of span `sp` sees (`AttnStep::row_keys`), into `keys`.
fn chunk_keys(
    keys: &mut Vec<usize>,
    step: &AttnStep<'_>,
    sp: &SeqSpan,
    t: usize,
    g: usize,
    c: usize,
) {
    let (shape, cache) = (&step.shape, &step.cache);
    let rk = step.row_keys(sp, t);
    let lo = cache.first_visible(rk.pos) + c * ATTN_CHUNK;
    let hi = (lo + ATTN_CHUNK).min(rk.pos + 1);
    keys.clear();
    keys.extend((lo..hi).map(|j| cache.at(shape, sp.slot, rk.key(j)) + g * shape.head_dim));
}

/// The softmax partial of one chunk of keys for `gh` query heads `qg` (rows of `hd`):
/// `out` = [max score; gh], [sum of exp(score - max); gh], [sum of exp(score - max) *
/// value; gh rows of hd].
fn chunk_partial(
    qg: &[f32],
    hd: usize,
    (ks, vs): (&[u16], &[u16]),
    keys: &[usize],
    scale: f32,
    sc: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (gh, n) = (qg.len() / hd, keys.len());
    sc.resize(gh * n, 0.0);
    kernels::group_scores_f16(qg, hd, ks, keys, sc);
    for (i, s) in sc.chunks_exact_mut(n).enumerate() {
        (out[i], out[gh + i]) = exp_scaled(s, scale);
    }
    kernels::group_pv_f16(sc, hd, vs, keys, &mut out[2 * gh..2 * gh + gh * hd]);
}

/// Merges the partial `new` into `acc` (both as `chunk_partial` writes them).
fn merge_partial(acc: &mut [f32], new: &[f32], gh: usize, hd: usize) {
    for i in 0..gh {
        let m = acc[i].max(new[i]);
        let (a, b) = ((acc[i] - m).exp(), (new[i] - m).exp());
        acc[i] = m;
        acc[gh + i] = acc[gh + i] * a + new[gh + i] * b;
        let o = 2 * gh + i * hd;
        for (x, &y) in acc[o..o + hd].iter_mut().zip(&new[o..o + hd]) {
            *x = *x * a + y * b;
        }
    }
}

/// The attention output of a merged partial: weighted values over the sum (with each
/// head's sink logit in the sum, where the model has sinks).
fn finish_partial(acc: &[f32], gh: usize, hd: usize, sinks: Option<&[f32]>, o: &mut [f32]) {
    for i in 0..gh {
        let inv = match sinks {
            None => 1.0 / acc[gh + i],
            Some(s) => sink_share(acc[i], acc[gh + i], s[i]),
        };
        let src = &acc[2 * gh + i * hd..2 * gh + (i + 1) * hd];
        for (x, &y) in o[i * hd..(i + 1) * hd].iter_mut().zip(src) {
            *x = y * inv;
        }
    }
}

/// `attention_grouped`'s split rows, once the pool is done: each one's chunk partials
/// (`group * (2 + hd)` floats a chunk, from its first task's offset) merged in chunk order
/// on this thread, its partial buffer reused, then finished into the output.
fn merge_split_rows(
    tasks: &[Task],
    step: &AttnStep<'_>,
    partials: &[f32],
    chunks_of: impl Fn(&SeqSpan) -> usize,
    sinks: Option<&[f32]>,
    optr: SharedPtr,
) {
    let (spans, shape) = (step.spans, step.shape);
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let (group, width_q) = (heads / kv_heads, heads * hd);
    let rec = group * (2 + hd);
    PARTIAL.with(|part| {
        let mut acc = part.borrow_mut();
        let mut i = 0;
        while i < tasks.len() {
            let (si, g, c, at) = tasks[i];
            if c == ALL {
                i += 1;
                continue;
            }
            let n_chunks = chunks_of(&spans[si]);
            let row = spans[si].row * width_q;
            for (h0, gh) in head_subgroups(g, group) {
                let (off, w) = ((h0 - g * group) * (2 + hd), gh * (2 + hd));
                acc.clear();
                acc.extend_from_slice(&partials[at + off..at + off + w]);
                for k in 1..n_chunks {
                    let r = at + k * rec + off;
                    merge_partial(&mut acc, &partials[r..r + w], gh, hd);
                }
                // SAFETY: the pool is done; this (row, head group) is written once.
                let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                finish_partial(&acc, gh, hd, sinks.map(|s| &s[h0..h0 + gh]), o);
            }
            i += n_chunks;
        }
    });
}

/// Scores times `scale`, then exp(score - max) in place; returns (max, sum of the exps),
/// summed in order.
fn exp_scaled(sc: &mut [f32], scale: f32) -> (f32, f32) {
    let mut mx = f32::NEG_INFINITY;
    for s in sc.iter_mut() {
        *s *= scale;
        mx = mx.max(*s);
    }
    map1(sc, |s| exp_f32(s - mx));
    (mx, sc.iter().sum())
}

/// Scores times `scale`, then softmax in place: `exp_scaled`, then scaled by 1 / sum (the
/// sum with the sink's term, where there is a sink).
pub(super) fn softmax_scaled(sc: &mut [f32], scale: f32, sink: Option<f32>) {
    let (mx, sum) = exp_scaled(sc, scale);
    let inv = match sink {
        None => 1.0 / sum,
        Some(s) => sink_share(mx, sum, s),
    };
    sc.iter_mut().for_each(|s| *s *= inv);
}

/// What exp(score - `mx`) is multiplied by to become a probability when a sink logit
/// joins the softmax (`sum` = the sum of the scores' exp(score - mx)): with m the larger of
/// mx and the sink, e^(mx - m) / (sum e^(mx - m) + e^(sink - m)).
fn sink_share(mx: f32, sum: f32, sink: f32) -> f32 {
    let m = mx.max(sink);
    let a = (mx - m).exp();
    a / (sum * a + (sink - m).exp())
}
