//! Matrix products on the CPU (`Backend::matmuls`, `matmul_head`): the decode rows
//! through the dot-product kernels (8- or 16-bit activations in `q8.rs`, f32 in `gemv.rs`),
//! a weight's output columns in chunks, every product's chunks one op; the prefill rows
//! through tiles of weights dequantized to f32 and `matrixmultiply`'s sgemm. Either way a
//! row's numbers do not depend on the other rows of its batch.

use crate::backend::cpu::{f32_vector, weight_bytes, CpuBackend, CpuMem, Par, Scratch, SharedPtr};
use crate::backend::cpu::{gemv, q8, RES, RES4, TILE};
use crate::backend::MatmulOut;
use crate::dtype::DType;

/// Dequantized weights a thread's sgemm tile holds at most (512 KiB of f32), unless
/// TILE_ROWS_MIN rows need more.
const TILE_F32S: usize = 128 * 1024;
const TILE_ROWS_MIN: usize = 32;
/// At most 56 rows: matrixmultiply's sgemm allocates a packing buffer of KC x (MC + rows)
/// f32 a call (KC 256, MC 64), and 56 rows keep it under glibc's 128 KiB mmap threshold.
/// A larger one is mmapped, and once freed it raises the threshold, so that every later
/// one stays in the thread's heap: 224-row tiles left SmolLM2's resident set 2.7 MB larger,
/// which under a 96 MiB memory cgroup pushed the executable's pages out (decode 1.5
/// tokens/s instead of 47).
const TILE_ROWS_MAX: usize = 56;
/// sgemm's packing buffer for a tile of TILE_ROWS_MAX rows (see there).
pub(super) const SGEMM_PACK_BYTES: usize = 256 * (64 + TILE_ROWS_MAX) * std::mem::size_of::<f32>();

/// Weight rows per sgemm tile for rows of `k`: as many as TILE_F32S holds, from
/// TILE_ROWS_MIN to TILE_ROWS_MAX, a multiple of 8. sgemm packs the whole block of
/// activations once a call, so a tile of few rows packs them again and again (32 rows
/// spent a fifth of SmolLM2's prefill packing; 56 rows run it 5-10% faster). Whatever the
/// tile, an output's bits are the same: its dot product over k, in sgemm's order.
fn tile_rows(k: usize) -> usize {
    (TILE_F32S / k.max(1) / 8 * 8).clamp(TILE_ROWS_MIN, TILE_ROWS_MAX)
}

/// The most f32 a tile takes for rows of at most `k_max`.
pub(super) fn tile_f32s_max(k_max: usize) -> usize {
    (TILE_ROWS_MAX * k_max)
        .min(TILE_F32S)
        .max(TILE_ROWS_MIN * k_max)
}

/// The activations a decode matmul's integer kernels see: f32 (the reference, `--exact`),
/// 8 bits (every matmul on the fast path) or 16 bits (the output head on the fast path).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Acts {
    F32,
    I8,
    I16,
}

impl CpuBackend {
    /// `Backend::matmuls` with the activations of decode rows 8-bit, 16-bit or f32: the
    /// decode rows are converted once for every product, and the products' tasks run as
    /// one op (a weight's output columns in chunks, every weight's chunks together).
    pub(super) fn matmul_as(
        &self,
        x: &CpuMem,
        rows: usize,
        gemv_rows: usize,
        outs: &mut [MatmulOut<'_, CpuMem>],
        acts: Acts,
    ) {
        let n = outs.len();
        assert!(
            (1..=MAX_SHARED).contains(&n),
            "{n} products of one activation (1 to {MAX_SHARED})"
        );
        let k = outs[0].w.cols;
        for o in outs.iter_mut() {
            let m = o.w.rows;
            assert!(
                o.w.cols == k && x.len / 4 >= rows * k && o.out.len / 4 >= rows * m,
                "matmul shapes: x {} f32, out {} f32 for [{rows}, {k}] x [{m}, {}]^T",
                x.len / 4,
                o.out.len / 4,
                o.w.cols
            );
        }
        assert!(gemv_rows <= rows);
        let xs = &x.f32s()[..rows * k];
        let g = gemv_rows;
        let mm: [Matmul; MAX_SHARED] = std::array::from_fn(|i| {
            let o = &mut outs[i.min(n - 1)];
            let w = o.w;
            Matmul {
                dtype: w.dtype,
                wb: weight_bytes(&w),
                rb: w.dtype.row_bytes(k as u64).expect("validated") as usize,
                xs,
                k,
                m: w.rows,
                out: SharedPtr(o.out.f32s_mut().as_mut_ptr()),
                threads: self.threads,
                path: DecodePath::of(w.dtype, acts),
            }
        });
        let mm = &mm[..n];
        let mut scratch = self.scratch();
        let Scratch { xsums, q8, q16, .. } = &mut *scratch;
        // Each conversion of the decode rows once, for every product that takes it.
        let needs = |p: DecodePath| g > 0 && mm.iter().any(|m| m.path == p);
        if needs(DecodePath::Int8) {
            q8::quantize_rows(&xs[..g * k], k, q8);
        }
        if needs(DecodePath::Int16) {
            q8::quantize_rows(&xs[..g * k], k, q16);
        }
        if needs(DecodePath::Rows4) {
            gemv::block_sums_into(&xs[..g * k], xsums);
        }
        let fast = acts != Acts::F32;
        let acts = DecodeActs { q8, q16, xsums };
        self.run(|par| {
            // Single-token rows (decode) run through the dot-product kernels, whose result for
            // a row does not depend on the other rows; the rest (prefill chunks) through
            // dequantized tiles and sgemm, also row by row independent. So a sequence's
            // numbers are the same alone or in any batch.
            if g > 0 {
                decode_rows(par, mm, g, &acts);
            }
            if rows > g {
                prefill_rows(par, mm, g, rows - g, fast);
            }
        });
        for o in outs.iter_mut() {
            if let Some(b) = o.bias {
                let m = o.w.rows;
                let bv = f32_vector(&b, &mut scratch.weights);
                for orow in o.out.f32s_mut()[..rows * m].chunks_exact_mut(m) {
                    for (v, bb) in orow.iter_mut().zip(bv) {
                        *v += bb;
                    }
                }
            }
        }
    }
}

/// Whether prefill rows of `dtype` weights take `floatdot::tile_product_bf16`: bf16
/// weights, not `--exact` (`fast`), and a CPU with AVX-512 BF16.
fn bf16_dots(dtype: DType, fast: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        fast && dtype == DType::BF16 && super::floatdot::has_avx512_bf16()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, fast);
        false
    }
}

/// Products of one activation that `matmuls` runs as one op, at most.
const MAX_SHARED: usize = 4;

/// How a weight meets the decode rows: integer dots against their 8- or 16-bit blocks,
/// float weights' row groups (`floatdot`, four or eight rows), the four-row f32 kernels
/// (with per-block sums), or the one-row f32 dots.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DecodePath {
    Int8,
    Int16,
    Float,
    Rows4,
    Rows,
}

impl DecodePath {
    /// Decode rows one weight read serves.
    fn group(self) -> usize {
        match self {
            DecodePath::Int8 | DecodePath::Int16 => q8::ROWS_MAX,
            #[cfg(target_arch = "x86_64")]
            DecodePath::Float => super::floatdot::rows(),
            #[cfg(not(target_arch = "x86_64"))]
            DecodePath::Float => 1,
            DecodePath::Rows4 | DecodePath::Rows => 4,
        }
    }

    fn of(dtype: DType, acts: Acts) -> DecodePath {
        let int = q8::covers(dtype);
        #[cfg(target_arch = "x86_64")]
        let float = super::floatdot::covers(dtype) && super::simd::has_avx2();
        #[cfg(not(target_arch = "x86_64"))]
        let float = false;
        match acts {
            // Float weights take f32 activations whatever the numerics (floatdot.rs).
            _ if float => DecodePath::Float,
            Acts::I8 if int => DecodePath::Int8,
            Acts::I16 if int => DecodePath::Int16,
            _ if gemv::has_gemv4(dtype) => DecodePath::Rows4,
            _ => DecodePath::Rows,
        }
    }
}

/// The decode rows converted for the products that need it (`DecodePath`).
struct DecodeActs<'a> {
    q8: &'a [q8::Q8Block],
    q16: &'a [q8::Q16Block],
    xsums: &'a [f32],
}

/// One matrix product's operands, shared by its tasks: weight rows `wb` (`rb` bytes each,
/// `m` of them), activations `xs` (rows of `k`), the output rows (`m` wide), and the path
/// its decode rows take.
#[derive(Clone, Copy)]
struct Matmul<'a> {
    dtype: DType,
    wb: &'a [u8],
    rb: usize,
    xs: &'a [f32],
    k: usize,
    m: usize,
    out: SharedPtr,
    threads: usize,
    path: DecodePath,
}

impl Matmul<'_> {
    fn decode_chunk(&self) -> usize {
        decode_chunk(self.m, self.threads)
    }

    /// Weight rows per prefill task: a dequantized tile's (`tile_rows`), or with bf16 dots
    /// (no tile: the weights are read as they are) about two tasks a thread, since every
    /// task reads the whole activation block once.
    fn prefill_task_rows(&self, fast: bool) -> usize {
        if bf16_dots(self.dtype, fast) {
            self.m
                .div_ceil(2 * self.threads)
                .next_multiple_of(4)
                .max(16)
        } else {
            tile_rows(self.k)
        }
    }

    /// Rows `r0..r0 + n` of the first `g` decode rows against weight rows `j0..j1`: into
    /// `res` (one column a row; returns true), or straight into the output (false).
    #[allow(clippy::too_many_arguments)] // a task's place and its operands
    fn decode_task(
        &self,
        acts: &DecodeActs<'_>,
        g: usize,
        r0: usize,
        n: usize,
        (j0, j1): (usize, usize),
        res: &mut [[f32; q8::ROWS_MAX]],
    ) -> bool {
        let Matmul {
            dtype,
            wb,
            rb,
            xs,
            k,
            m,
            out: optr,
            ..
        } = *self;
        let nb = k / 32;
        let w = &wb[j0 * rb..j1 * rb];
        // A short group repeats its last row (results dropped).
        let pick = |i: usize| (r0 + i).min(g - 1);
        match self.path {
            DecodePath::Int8 => {
                let rows: [&[q8::Q8Block]; q8::ROWS_MAX] =
                    std::array::from_fn(|i| &acts.q8[pick(i) * nb..(pick(i) + 1) * nb]);
                q8::gemv_rows(dtype, w, rb, &rows[..n], res);
                true
            }
            DecodePath::Int16 => {
                let rows: [&[q8::Q16Block]; q8::ROWS_MAX] =
                    std::array::from_fn(|i| &acts.q16[pick(i) * nb..(pick(i) + 1) * nb]);
                q8::gemv_rows16(dtype, w, rb, &rows[..n], res);
                true
            }
            #[cfg(target_arch = "x86_64")]
            DecodePath::Float => {
                let xr: [&[f32]; super::floatdot::ROWS] =
                    std::array::from_fn(|i| &xs[pick(i) * k..(pick(i) + 1) * k]);
                super::floatdot::gemv_rows(dtype, w, rb, &xr[..n], res);
                true
            }
            #[cfg(not(target_arch = "x86_64"))]
            DecodePath::Float => unreachable!("float kernels are x86_64's"),
            DecodePath::Rows4 if n > 1 => {
                let xr: [&[f32]; 4] = std::array::from_fn(|i| &xs[pick(i) * k..(pick(i) + 1) * k]);
                let xsr: [&[f32]; 4] =
                    std::array::from_fn(|i| &acts.xsums[pick(i) * nb..(pick(i) + 1) * nb]);
                RES4.with(|r4| {
                    let mut r4 = r4.borrow_mut();
                    r4.clear();
                    r4.resize(res.len(), [0f32; 4]);
                    gemv::gemv4(dtype, w, rb, &xr, &xsr, &mut r4);
                    for (o, v) in res.iter_mut().zip(r4.iter()) {
                        o[..4].copy_from_slice(v);
                    }
                });
                true
            }
            DecodePath::Rows4 | DecodePath::Rows => {
                for r in r0..r0 + n {
                    // SAFETY: the task of chunk j0..j1 writes out[r][j0..j1] only.
                    let o = unsafe { optr.slice(r * m + j0, j1 - j0) };
                    gemv::gemv(dtype, w, rb, &xs[r * k..(r + 1) * k], o);
                }
                false
            }
        }
    }
}

/// Output columns per decode task of a product of `m` columns: about `TASKS_PER_THREAD`
/// tasks per thread (claimed as threads free up, so a thread that fell behind takes fewer),
/// at least 16 columns.
pub(super) fn decode_chunk(m: usize, threads: usize) -> usize {
    const TASKS_PER_THREAD: usize = 4;
    m.div_ceil(threads * TASKS_PER_THREAD).max(16)
}

/// Task `t` of tasks numbered product by product, `count(mm)` of them each: (product, its
/// task).
fn locate<'a>(
    mm: &'a [Matmul<'a>],
    count: impl Fn(&Matmul) -> usize,
    mut t: usize,
) -> (&'a Matmul<'a>, usize) {
    for p in mm {
        let c = count(p);
        if t < c {
            return (p, t);
        }
        t -= c;
    }
    unreachable!("task past the products' tasks")
}

/// The first `g` rows of every product, in groups of up to `DecodePath::group` rows (a
/// weight block read once per group), each product's output chunk `j0..j1` a task; a
/// task's results are scattered into the output rows.
fn decode_rows(par: &Par, mm: &[Matmul], g: usize, acts: &DecodeActs<'_>) {
    let count = |p: &Matmul| p.m.div_ceil(p.decode_chunk());
    let total = mm.iter().map(count).sum();
    par.for_each(total, |t| {
        let (p, c) = locate(mm, count, t);
        let (m, chunk) = (p.m, p.decode_chunk());
        let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(m));
        let group = p.path.group();
        RES.with(|res| {
            let mut res = res.borrow_mut();
            res.clear();
            res.resize(j1 - j0, [0f32; q8::ROWS_MAX]);
            for r0 in (0..g).step_by(group) {
                let n = (g - r0).min(group);
                if !p.decode_task(acts, g, r0, n, (j0, j1), &mut res) {
                    continue;
                }
                for i in 0..n {
                    // SAFETY: task c writes out[r][j0..j1] only; tasks are disjoint in j.
                    let o = unsafe { p.out.slice((r0 + i) * m + j0, j1 - j0) };
                    for (oj, rj) in o.iter_mut().zip(res.iter()) {
                        *oj = rj[i];
                    }
                }
            }
        });
    });
}

/// `t` prefill rows from row `g` on, of every product: weight tiles dequantized to f32,
/// then sgemm (block formats) or `floatdot::tile_product` (float weights), a tile of each
/// product's rows a task. `fast` (not `--exact`): bf16 weights meet bf16 activations
/// where the CPU has AVX-512 BF16 (`floatdot::tile_product_bf16`, no dequantized tile).
fn prefill_rows(par: &Par, mm: &[Matmul], g: usize, t: usize, fast: bool) {
    let count = |p: &Matmul| p.m.div_ceil(p.prefill_task_rows(fast));
    let total = mm.iter().map(count).sum();
    par.for_each(total, |task| {
        let (p, ti) = locate(mm, count, task);
        let Matmul {
            dtype,
            wb,
            rb,
            xs,
            k,
            m,
            out: optr,
            ..
        } = *p;
        let xt = &xs[g * k..(g + t) * k];
        let task_rows = p.prefill_task_rows(fast);
        let (j0, j1) = (ti * task_rows, ((ti + 1) * task_rows).min(m));
        let nb = j1 - j0;
        let rows = tile_rows(k);
        TILE.with(|tile| {
            let mut tile = tile.borrow_mut();
            tile.resize(rows * k, 0.0);
            #[cfg(target_arch = "x86_64")]
            if bf16_dots(dtype, fast) {
                let w = (&wb[j0 * rb..j1 * rb], rb, nb);
                // The tile scratch holds the activations' bf16 blocks: TILE_ROWS_MIN * k f32
                // is enough from k = 31 on; narrower rows (a toy model) take a few more.
                let need = super::floatdot::bf16_scratch_f32s(k);
                if tile.len() < need {
                    tile.resize(need, 0.0);
                }
                // SAFETY: out[g.., j0..j1] (row stride m), disjoint across tasks; the
                // activations and weights are live slices of those shapes.
                unsafe {
                    let out = optr.at(g * m + j0);
                    super::floatdot::tile_product_bf16(xt, (t, k), w, &mut tile, out, m)
                };
                return;
            }
            gemv::dequant_rows(dtype, &wb[j0 * rb..j1 * rb], rb, k, &mut tile[..nb * k]);
            // Float weights: the tile against the rows straight from them, packed never
            // (sgemm packed the whole activation block again for every tile).
            #[cfg(target_arch = "x86_64")]
            if super::floatdot::covers(dtype) && super::simd::has_avx2() {
                // SAFETY: out[g.., j0..j1] (row stride m), disjoint across tasks; the
                // activations and the tile are live slices of those shapes.
                unsafe {
                    super::floatdot::tile_product(
                        xt,
                        (t, k),
                        &tile[..nb * k],
                        nb,
                        optr.at(g * m + j0),
                        m,
                    )
                };
                return;
            }
            // SAFETY: C = X[t, k] . T^T lands in out[g.., j0..j1] (row stride m),
            // disjoint across tasks; A and B are live slices of the given sizes.
            unsafe {
                matrixmultiply::sgemm(
                    t,
                    k,
                    nb,
                    1.0,
                    xt.as_ptr(),
                    k as isize,
                    1,
                    tile.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    optr.at(g * m + j0),
                    m as isize,
                    1,
                );
            }
        });
    });
}
