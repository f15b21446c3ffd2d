//! The CUDA kernels executed without a GPU: tests/emulator/cuda_emu.cpp compiles the very
//! sources NVRTC compiles (kernels/*.cu) for the CPU with g++, every CUDA thread a fiber,
//! and runs the launches these tests script. Their outputs are compared with the CPU
//! backend on the same inputs, and with themselves across batch shapes. This checks what
//! the kernels compute (indexing, dequantization, the multi-row GEMV's per-row order, the
//! attention's online softmax and head groups), not how fast; the GPU tests in
//! tests/tests/cuda.rs check the rest where a GPU is lent.

use sluice::backend::cpu::CpuBackend;
use sluice::backend::cuda::SpanRows;
use sluice::backend::{AttnStep, Backend, KvDtype};
use sluice::dtype::{DType, ALL_DTYPES};
use sluice_tests::ops::{close, f16_bits, f32_bytes, random_weights, wref, AttnCase, Rng};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// A decode-row GEMV's grid as the backend launches it.
fn gemv_grid(m: usize, rows: usize, dt: DType) -> (usize, usize) {
    let d = sluice::backend::cuda::kernels::Dims::gemv(m, rows, dt);
    (d.grid.0 as usize, d.grid.1 as usize)
}

/// The one-row GEMV's grid as the backend launches it.
fn gemv1_grid(m: usize) -> (usize, usize) {
    let d = sluice::backend::cuda::kernels::Dims::gemv1(m);
    (d.grid.0 as usize, d.grid.1 as usize)
}

/// The one-pair-a-block grouped GEMV's grid as the backend launches it.
fn gemv1_grouped_grid(m: usize, pairs: usize) -> (usize, usize) {
    let d = sluice::backend::cuda::kernels::Dims::gemv1_grouped(m, pairs);
    (d.grid.0 as usize, d.grid.1 as usize)
}

/// A decode-row GEMV's block as the backend launches it.
const GEMV_BLOCK: usize = sluice::backend::cuda::kernels::GEMV_THREADS as usize;

/// The emulator is built with UBSan, fatal; with SLUICE_EMU_ASAN=1 with AddressSanitizer
/// too (its buffers have no slack: an overrun is reported, not read from a neighbour). The
/// fibers' switches make AddressSanitizer slow (the suite takes 13 minutes on 2 cores
/// against half a minute), so CI leaves it out; run it after changing a kernel's indexing.
fn sanitizers() -> &'static [&'static str] {
    if std::env::var_os("SLUICE_EMU_ASAN").is_some_and(|v| v == "1") {
        &[
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
        ]
    } else {
        &["-fsanitize=undefined", "-fno-sanitize-recover=all"]
    }
}

/// How long one script may run: a barrier some threads never reach (a divergent
/// `__syncthreads`) makes the emulator spin; it is killed and the test fails.
const SCRIPT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// The emulator, built once per source version into the target directory.
fn emulator() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let src = root.join("tests/emulator/cuda_emu.cpp");
        let kernels = root.join("kernels");
        let mut text = std::fs::read(&src).expect("tests/emulator/cuda_emu.cpp");
        for (name, body) in sluice::backend::cuda::KERNELS {
            text.extend_from_slice(name.as_bytes());
            text.extend_from_slice(body.as_bytes());
        }
        text.extend_from_slice(sluice::backend::cuda::COMMON.as_bytes());
        text.extend_from_slice(sanitizers().join(" ").as_bytes());
        let key = xxhash_rust::xxh3::xxh3_64(&text);
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda_emu-{key:016x}"));
        if !out.exists() {
            let tmp = out.with_extension(format!("tmp{}", std::process::id()));
            let o = Command::new("g++")
                .args(["-std=c++20", "-O2", "-ffp-contract=off", "-Wall"])
                .args(sanitizers())
                .args(["-Wno-unknown-pragmas", "-Wno-unused-function", "-I"])
                .arg(&kernels)
                .arg(&src)
                .arg("-o")
                .arg(&tmp)
                .output()
                .unwrap_or_else(|e| {
                    panic!("running g++ to build the CUDA emulator: {e} (install g++)")
                });
            assert!(
                o.status.success(),
                "g++ on tests/emulator/cuda_emu.cpp:\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
            std::fs::rename(&tmp, &out).expect("emulator binary");
        }
        out
    })
}

/// A script of emulator commands: buffers in, launches, buffers out.
struct Script {
    dir: tempfile::TempDir,
    lines: String,
    saved: Vec<PathBuf>,
}

impl Script {
    fn new() -> Script {
        Script {
            dir: tempfile::tempdir().expect("temp dir"),
            lines: String::new(),
            saved: Vec::new(),
        }
    }

    fn load(&mut self, id: usize, bytes: &[u8]) {
        let p = self.dir.path().join(format!("in{id}"));
        std::fs::write(&p, bytes).expect("write input");
        self.lines += &format!("load {id} {}\n", p.display());
    }

    fn zeros(&mut self, id: usize, bytes: usize) {
        self.lines += &format!("zeros {id} {bytes}\n");
    }

    fn addrs(&mut self, id: usize, args: &[String]) {
        self.lines += &format!("addrs {id} {}\n", args.join(" "));
    }

    fn launch(&mut self, name: &str, grid: (usize, usize), block: usize, args: &[String]) {
        self.launch3(name, (grid.0, grid.1, 1), block, args)
    }

    fn launch3(&mut self, name: &str, grid: (usize, usize, usize), block: usize, args: &[String]) {
        self.lines += &format!(
            "launch {name} {} {} {} {block} {}\n",
            grid.0,
            grid.1,
            grid.2,
            args.join(" ")
        );
    }

    /// Saves buffer `id` now; its bytes are `run()`'s output number (the call's return).
    fn save(&mut self, id: usize) -> usize {
        let p = self.dir.path().join(format!("out{}", self.saved.len()));
        self.lines += &format!("save {id} {}\n", p.display());
        self.saved.push(p);
        self.saved.len() - 1
    }

    fn run(self) -> Vec<Vec<f32>> {
        use std::io::Write;
        let mut child = Command::new(emulator())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the emulator");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(self.lines.as_bytes())
            .expect("script");
        // A watchdog kills a script that runs past SCRIPT_TIMEOUT.
        let pid = child.id() as i32;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let killed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watchdog = {
            let (done, killed) = (done.clone(), killed.clone());
            std::thread::spawn(move || {
                let t0 = std::time::Instant::now();
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    if t0.elapsed() > SCRIPT_TIMEOUT {
                        killed.store(true, std::sync::atomic::Ordering::Release);
                        // SAFETY: kill(2) on the child this test spawned and has not reaped.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
            })
        };
        let o = child.wait_with_output().expect("emulator");
        done.store(true, std::sync::atomic::Ordering::Release);
        let _ = watchdog.join();
        if killed.load(std::sync::atomic::Ordering::Acquire) {
            let script = self.dir.path().join("script");
            let _ = std::fs::write(&script, &self.lines);
            let kept = self.dir.keep();
            panic!(
                "the emulator ran past {SCRIPT_TIMEOUT:?} (a barrier some threads never reach?); rerun: {} < {}",
                emulator().display(),
                kept.join("script").display()
            );
        }
        if !o.status.success() {
            // Keep the inputs and the script to rerun by hand.
            let script = self.dir.path().join("script");
            let _ = std::fs::write(&script, &self.lines);
            let kept = self.dir.keep();
            panic!(
                "emulator failed ({}); rerun: {} < {}\n{}",
                o.status,
                emulator().display(),
                kept.join("script").display(),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        self.saved
            .iter()
            .map(|p| {
                std::fs::read(p)
                    .expect("saved buffer")
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            })
            .collect()
    }
}

fn b(id: usize, off: usize) -> String {
    format!("b{id}+{off}")
}
fn i(v: usize) -> String {
    format!("i:{v}")
}

fn kernel_suffix(d: DType) -> String {
    d.name().to_ascii_lowercase()
}

fn cpu_matmul(x: &[f32], rows: usize, w: &[u8], dt: DType, m: usize, k: usize) -> Vec<f32> {
    let cpu = CpuBackend::new(64 << 20, 1).expect("cpu backend");
    let xm = cpu_put(&cpu, &f32_bytes(x));
    let wm = cpu_put(&cpu, w);
    let mut out = cpu.alloc(rows * m * 4, "out").expect("alloc");
    let wr = wref(&wm, dt, m, k);
    cpu.matmul(&xm, rows, rows, wr, None, &mut out);
    let mut v = vec![0f32; rows * m];
    cpu.download_f32(&out, 0, &mut v);
    cpu.check().expect("cpu matmul");
    v
}

fn cpu_put(cpu: &CpuBackend, bytes: &[u8]) -> sluice::backend::cpu::CpuMem {
    let mut mem = cpu.alloc(bytes.len(), "test").expect("alloc");
    cpu.upload(&mut mem, bytes).expect("upload");
    mem
}

fn same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

/// Every weight type's decode GEMV against the CPU backend at 20 rows (two full groups of
/// GEMV_R and a partial one), and against itself: the first 1 and 9 rows, a row alone (the
/// one-row kernel) and the grouped (mixture) forms give the same bits as that row among 20. Dense rows also at
/// k = 262 (a tail past the last 8-weight chunk, rows not 16-byte aligned).
#[test]
fn gemv_kernels_match_the_cpu_backend_and_do_not_depend_on_the_batch() {
    let mut rng = Rng::new(5);
    // 23 weight rows: the last block holds 3 of GEMV_W, 1 of Q6_K's 2 and of GEMV1_W.
    let (m, rows) = (23usize, 20usize);
    let mut cases: Vec<(DType, usize)> = ALL_DTYPES.iter().map(|&d| (d, 512)).collect();
    cases.extend([(DType::F32, 262), (DType::F16, 262), (DType::BF16, 262)]);
    for (dt, k) in cases {
        let name = kernel_suffix(dt);
        let x: Vec<f32> = (0..rows * k).map(|_| rng.symmetric_f32()).collect();
        let w = random_weights(dt, m, k, &mut rng);
        let mut s = Script::new();
        s.load(0, &w);
        s.load(1, &f32_bytes(&x));
        let grid = |n: usize| gemv_grid(m, n, dt);
        let gemv_w = |s: &mut Script, w: usize, n: usize, x_off: usize, out: usize| {
            s.zeros(out, n * m * 4);
            s.launch(
                &format!("gemv_{name}"),
                grid(n),
                GEMV_BLOCK,
                &[b(w, 0), b(1, x_off), b(out, 0), i(m), i(k), i(n)],
            );
            s.save(out)
        };
        let gemv = |s: &mut Script, n: usize, x_off: usize, out: usize| gemv_w(s, 0, n, x_off, out);
        let gemv_of = |s: &mut Script, w: usize, n: usize, out: usize| gemv_w(s, w, n, 0, out);
        // The one-row kernel, as the backend launches it for a step of one decode row.
        let gemv1 = |s: &mut Script, x_off: usize, out: usize| {
            s.zeros(out, m * 4);
            s.launch(
                &format!("gemv1_{name}"),
                gemv1_grid(m),
                GEMV_BLOCK,
                &[b(0, 0), b(1, x_off), b(out, 0), i(m), i(k)],
            );
            s.save(out)
        };
        let full = gemv(&mut s, rows, 0, 2);
        let first1 = gemv(&mut s, 1, 0, 3);
        let first9 = gemv(&mut s, 9, 0, 4);
        let alone: Vec<(usize, usize)> = [0usize, 8, 13, 19]
            .iter()
            .enumerate()
            .map(|(n, &r)| (r, gemv1(&mut s, r * k * 4, 10 + n)))
            .collect();
        // The grouped form: (expert, activation row) pairs, expert-major as the backend
        // makes them, over two experts (this weight and a second one), in runs that cross
        // the kernel's blocks of 8 pairs: A A A B B B B B | B B A B B.
        let w2 = random_weights(dt, m, k, &mut rng);
        s.load(8, &w2);
        let full2 = gemv_of(&mut s, 8, rows, 9);
        let experts = [0usize, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1];
        let picked: Vec<u32> = (0..experts.len())
            .map(|_| (rng.next_u64() % rows as u64) as u32)
            .collect();
        let addrs: Vec<String> = experts
            .iter()
            .map(|&e| b(if e == 0 { 0 } else { 8 }, 0))
            .collect();
        s.addrs(5, &addrs);
        s.load(
            6,
            &picked
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        s.zeros(7, picked.len() * m * 4);
        s.launch(
            &format!("gemv_grouped_{name}"),
            gemv_grid(m, picked.len(), dt),
            GEMV_BLOCK,
            &[
                b(5, 0),
                b(6, 0),
                b(1, 0),
                b(7, 0),
                i(m),
                i(k),
                i(picked.len()),
            ],
        );
        let grouped = s.save(7);
        // The one-pair-a-block form the backend takes where no two neighbouring pairs share
        // an expert: picked rows (x_rows given), then rows 0.. in order (x_rows null, as the
        // down projection passes it).
        let singles = [0usize, 1, 0, 1, 0];
        let single_addrs: Vec<String> = singles
            .iter()
            .map(|&e| b(if e == 0 { 0 } else { 8 }, 0))
            .collect();
        s.addrs(11, &single_addrs);
        let grouped1 = |s: &mut Script, x_rows: String, out: usize| {
            s.zeros(out, singles.len() * m * 4);
            s.launch(
                &format!("gemv1_grouped_{name}"),
                gemv1_grouped_grid(m, singles.len()),
                GEMV_BLOCK,
                &[
                    b(11, 0),
                    x_rows,
                    b(1, 0),
                    b(out, 0),
                    i(m),
                    i(k),
                    i(singles.len()),
                ],
            );
            s.save(out)
        };
        let single_picked = grouped1(&mut s, b(6, 0), 12);
        let single_in_order = grouped1(&mut s, i(0), 13);
        let out = s.run();
        let what = |s: &str| format!("gemv_{name} (k {k}): {s}");
        close(
            &what("20 rows against the CPU backend"),
            &cpu_matmul(&x, rows, &w, dt, m, k),
            &out[full],
            m,
            1e-4,
        );
        same_bits(&what("the first row"), &out[first1], &out[full][..m]);
        same_bits(&what("the first 9 rows"), &out[first9], &out[full][..9 * m]);
        for (r, at) in alone {
            same_bits(
                &what(&format!("row {r} alone")),
                &out[at],
                &out[full][r * m..(r + 1) * m],
            );
        }
        for (p, (&r, &e)) in picked.iter().zip(&experts).enumerate() {
            let r = r as usize;
            let reference = if e == 0 { full } else { full2 };
            same_bits(
                &what(&format!("grouped pair {p} (expert {e}, row {r})")),
                &out[grouped][p * m..(p + 1) * m],
                &out[reference][r * m..(r + 1) * m],
            );
        }
        for (p, &e) in singles.iter().enumerate() {
            let reference = if e == 0 { full } else { full2 };
            let r = picked[p] as usize;
            same_bits(
                &what(&format!("one-pair block {p} (expert {e}, row {r})")),
                &out[single_picked][p * m..(p + 1) * m],
                &out[reference][r * m..(r + 1) * m],
            );
            same_bits(
                &what(&format!(
                    "one-pair block {p} (expert {e}, row {p}, x_rows null)"
                )),
                &out[single_in_order][p * m..(p + 1) * m],
                &out[reference][p * m..(p + 1) * m],
            );
        }
    }
}

/// Attention on the emulator against the CPU backend: query-head groups of 1, 3, 4 and 16
/// (two passes of the kernel's eight), heads of 32, 64, 80 and 256 dimensions, a sliding
/// window in a ring, attention sinks; f32 and f16 caches of random values; two decode rows
/// and a prefill span per step, the span also as a token tree (each tree row with the bits
/// of the kernels' lone decode row of its text).
#[test]
fn attention_kernels_match_the_cpu_backend() {
    let mut rng = Rng::new(9);
    let cpu = CpuBackend::new(64 << 20, 1).expect("cpu backend");
    for kv in [KvDtype::F32, KvDtype::F16] {
        for (heads, kv_heads, head_dim, ctx, window, with_sinks) in [
            (16usize, 1usize, 80usize, 90usize, None, true),
            (4, 4, 32, 60, None, false),
            (8, 2, 256, 70, Some(30usize), false),
            (6, 2, 64, 50, None, true),
        ] {
            let c = AttnCase::new(kv, (heads, kv_heads, head_dim), ctx, window, &mut rng);
            let sinks: Vec<f32> = (0..heads).map(|_| 2.0 * rng.symmetric_f32()).collect();
            for tree in [false, true] {
                let what = format!("{kv:?}: {heads} heads on {kv_heads}, {head_dim} dims, context {ctx}, window {window:?}, sinks {with_sinks}, tree {tree}");
                attention_case(&cpu, &c, (&sinks, with_sinks), tree, &what);
            }
        }
    }
}

/// The third span of `AttnCase` (5 rows at 10) as a token tree: parents root, 0, 0, 1, 2.
const TREE_ANCESTORS: [u64; 7] = [0, 0, 0b1, 0b11, 0b101, 0b1011, 0b10101];

/// One case of `attention_kernels_match_the_cpu_backend`, its third span a tree when
/// `tree`: the kernels against the CPU backend, and a tree row's bits against the kernels'
/// own lone decode row over the same keys in chain order.
fn attention_case(
    cpu: &CpuBackend,
    c: &AttnCase,
    (sinks, with_sinks): (&[f32], bool),
    tree: bool,
    what: &str,
) {
    let (heads, kv_heads, head_dim) = (c.shape.heads, c.shape.kv_heads, c.shape.head_dim);
    let (rows, wq, cache, kv) = (c.rows, heads * head_dim, c.cache, c.shape.kv);
    let window = cache.window;
    let anc: &[u64] = if tree { &TREE_ANCESTORS } else { &[] };
    let step = AttnStep {
        layer: 0,
        spans: &c.spans,
        shape: c.shape,
        cache,
        ancestors: anc,
    };
    // The CPU backend.
    let (qm, km, vm, sm) = (
        cpu_put(cpu, &f32_bytes(&c.q)),
        cpu_put(cpu, &c.k),
        cpu_put(cpu, &c.v),
        cpu_put(cpu, &f32_bytes(sinks)),
    );
    let mut om = cpu.alloc(rows * wq * 4, "out").expect("alloc");
    let sref = with_sinks.then_some(wref(&sm, DType::F32, 1, heads));
    cpu.attention(&qm, &km, &vm, &step, sref, &mut om);
    let mut want = vec![0f32; rows * wq];
    cpu.download_f32(&om, 0, &mut want);
    cpu.check().expect("cpu attention");
    // The kernel: positions, cache bases and tree ancestors per row, from the CUDA
    // backend's own metadata builder (`SpanRows`, what it uploads).
    let width = kv_heads * head_dim;
    let SpanRows {
        pos,
        base,
        anc: anc_rows,
        ..
    } = SpanRows::of(&step).expect("span rows");
    let u32s = |v: &[u32]| v.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<_>>();
    let u64s = |v: &[u64]| v.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<_>>();
    let mut s = Script::new();
    s.load(0, &f32_bytes(&c.q));
    s.load(1, &c.k);
    s.load(2, &c.v);
    s.load(4, &u32s(&pos));
    s.load(5, &u64s(&base));
    s.load(6, &f32_bytes(sinks));
    s.load(9, &u64s(&anc_rows));
    let kernel = match kv {
        KvDtype::F32 => "attention_part_f32",
        KvDtype::F16 => "attention_part_f16",
    };
    let sink_arg = if with_sinks { b(6, 0) } else { "null".into() };
    let seen = |p: usize| p + 1 - cache.first_visible(p);
    // Rows r0..r1 of the step with splits of `split` positions, into buffer `out`; the
    // buffers of the cache, queries and metadata: `bufs` (k, v, q, pos, base, anc).
    let attend = |s: &mut Script,
                  (r0, r1): (usize, usize),
                  split: usize,
                  out: usize,
                  bufs: [usize; 6],
                  pos: &[u32]| {
        let [bk, bv, bq, bp, bb, ba] = bufs;
        let s_max = pos[r0..r1]
            .iter()
            .map(|&p| seen(p as usize).div_ceil(split))
            .max()
            .unwrap_or(1);
        let part = 100 + out;
        s.zeros(part, (r1 - r0) * s_max * heads * (head_dim + 2) * 4);
        s.launch3(
            kernel,
            (r1 - r0, kv_heads, s_max),
            256,
            &[
                b(bq, r0 * wq * 4),
                b(bk, 0),
                b(bv, 0),
                b(part, 0),
                b(bp, r0 * 4),
                b(bb, r0 * 8),
                b(ba, r0 * 8),
                i(heads),
                i(kv_heads),
                i(head_dim),
                format!("f:{:e}", c.shape.scale),
                i(cache.cap),
                i(window.unwrap_or(0)),
                i(split),
                i(s_max),
            ],
        );
        s.launch(
            "attention_combine_f32",
            (r1 - r0, heads),
            128,
            &[
                b(part, 0),
                b(out, r0 * wq * 4),
                b(bp, r0 * 4),
                i(heads),
                i(head_dim),
                i(window.unwrap_or(0)),
                i(split),
                i(s_max),
                sink_arg.clone(),
            ],
        );
    };
    let main = [1, 2, 0, 4, 5, 9];
    // One split per row (the backend's 1024 positions), splits of 16 positions, and
    // splits of 16 with the rows in two launches (the bits of one launch).
    s.zeros(3, rows * wq * 4);
    attend(&mut s, (0, rows), 1024, 3, main, &pos);
    let whole = s.save(3);
    s.zeros(7, rows * wq * 4);
    attend(&mut s, (0, rows), 16, 7, main, &pos);
    let split = s.save(7);
    s.zeros(8, rows * wq * 4);
    attend(&mut s, (0, 3), 16, 8, main, &pos);
    attend(&mut s, (3, rows), 16, 8, main, &pos);
    let grouped = s.save(8);
    // Each tree row alone: a causal row at its position over a cache whose positions from
    // the root hold its ancestors' K and V in depth order.
    let mut lone = Vec::new();
    if tree {
        let sp = c.spans[2];
        let kvb = kv.bytes();
        for t in 0..sp.n {
            let a = TREE_ANCESTORS[sp.row + t];
            let (mut k2, mut v2) = (c.k.clone(), c.v.clone());
            let path = (0..64).filter(|&r| a >> r & 1 == 1);
            for (d, r) in path.enumerate() {
                let from = cache.at(&c.shape, sp.slot, sp.pos + r) * kvb;
                let to = cache.at(&c.shape, sp.slot, sp.pos + d) * kvb;
                k2.copy_within(from..from + width * kvb, to);
                v2.copy_within(from..from + width * kvb, to);
            }
            let n = 20 + 10 * t;
            s.load(n, &k2);
            s.load(n + 1, &v2);
            s.load(
                n + 2,
                &f32_bytes(&c.q[(sp.row + t) * wq..(sp.row + t + 1) * wq]),
            );
            let p = [pos[sp.row + t]];
            s.load(n + 3, &u32s(&p));
            s.load(n + 4, &u64s(&base[sp.row + t..sp.row + t + 1]));
            s.load(n + 5, &u64s(&[0]));
            s.zeros(n + 6, wq * 4);
            attend(
                &mut s,
                (0, 1),
                1024,
                n + 6,
                [n, n + 1, n + 2, n + 3, n + 4, n + 5],
                &p,
            );
            lone.push((sp.row + t, s.save(n + 6)));
        }
    }
    let got = s.run();
    same_bits(
        &format!("{what}: rows in two launches"),
        &got[grouped],
        &got[split],
    );
    close(
        &format!("{what}, splits of 16"),
        &want,
        &got[split],
        head_dim,
        1e-5,
    );
    close(what, &want, &got[whole], head_dim, 1e-5);
    for (r, at) in lone {
        same_bits(
            &format!("{what}: tree row {r} and the lone row of its text"),
            &got[at],
            &got[whole][r * wq..(r + 1) * wq],
        );
    }
}

/// The prefill path's dequantization tiles and the embedding gather, for every weight type,
/// against the CPU backend's embedding of the same rows: exact for the K-quant-era formats
/// (their device decoders round every product and sum as the CPU's do), 1e-6 for the rest.
#[test]
fn dequantization_and_embedding_kernels_match_the_cpu_backend() {
    let mut rng = Rng::new(13);
    let (m, k) = (22usize, 512usize);
    let cpu = CpuBackend::new(64 << 20, 1).expect("cpu backend");
    for dt in ALL_DTYPES {
        let name = kernel_suffix(dt);
        let w = random_weights(dt, m, k, &mut rng);
        let ids: Vec<u32> = vec![3, 0, 21, 7, 7];
        let all: Vec<u32> = (0..m as u32).collect();
        let cpu_rows = |ids: &[u32]| {
            let wm = cpu_put(&cpu, &w);
            let mut out = cpu.alloc(ids.len() * k * 4, "out").expect("alloc");
            let wr = wref(&wm, dt, m, k);
            cpu.embedding(wr, ids, &mut out);
            let mut v = vec![0f32; ids.len() * k];
            cpu.download_f32(&out, 0, &mut v);
            cpu.check().expect("cpu embedding");
            v
        };
        let mut s = Script::new();
        s.load(0, &w);
        s.load(
            1,
            &ids.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<_>>(),
        );
        s.zeros(2, ids.len() * k * 4);
        s.launch(
            &format!("embedding_{name}"),
            (ids.len(), 1),
            256,
            &[b(0, 0), b(1, 0), b(2, 0), i(k)],
        );
        let gathered = s.save(2);
        let tile = (dt != DType::F32).then(|| {
            let n = m * k;
            s.zeros(3, n * 4);
            s.launch(
                &format!("dequant_{name}"),
                (n.div_ceil(256), 1),
                256,
                &[b(0, 0), b(3, 0), format!("u:{n}")],
            );
            s.save(3)
        });
        let out = s.run();
        let tol = if dt.is_quantized() && !matches!(dt, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
            0.0
        } else {
            1e-6
        };
        close(
            &format!("embedding_{name}"),
            &cpu_rows(&ids),
            &out[gathered],
            k,
            tol,
        );
        if let Some(t) = tile {
            close(&format!("dequant_{name}"), &cpu_rows(&all), &out[t], k, tol);
        }
    }
}

/// The decoder's other ops on the emulator against the CPU backend: RMS norm with f32, f16
/// and bf16 weights over rows wider than a block's first pass, RoPE, the KV-cache store into
/// f32 and f16 caches (the same bytes), SiLU, GELU and gpt-oss's clamped SwiGLU products,
/// add, scale and the bias add.
#[test]
fn norm_rope_kv_store_and_elementwise_kernels_match_the_cpu_backend() {
    let mut rng = Rng::new(17);
    let cpu = CpuBackend::new(64 << 20, 1).expect("cpu backend");
    let (rows, cols) = (5usize, 1100usize);
    let n = rows * cols;
    let x: Vec<f32> = (0..n).map(|_| rng.symmetric_f32() * 3.0).collect();
    let y: Vec<f32> = (0..n).map(|_| rng.symmetric_f32() * 3.0).collect();
    let download = |m: &sluice::backend::cpu::CpuMem, n: usize| {
        let mut v = vec![0f32; n];
        cpu.download_f32(m, 0, &mut v);
        cpu.check().expect("cpu op");
        v
    };
    let per_element = (n.div_ceil(256), 1);
    let mut s = Script::new();
    s.load(0, &f32_bytes(&x));
    s.load(1, &f32_bytes(&y));
    let mut checks: Vec<(String, Vec<f32>, usize, f64)> = Vec::new();

    for (id, dt) in [(10, DType::F32), (11, DType::F16), (12, DType::BF16)] {
        let w = random_weights(dt, 1, cols, &mut rng);
        let (xm, wm) = (cpu_put(&cpu, &f32_bytes(&x)), cpu_put(&cpu, &w));
        let mut om = cpu.alloc(n * 4, "out").expect("alloc");
        cpu.rms_norm(&xm, wref(&wm, dt, 1, cols), 1e-5, rows, &mut om);
        s.load(id, &w);
        s.zeros(id + 10, n * 4);
        let block = (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024);
        s.launch(
            &format!("rms_norm_{}", kernel_suffix(dt)),
            (rows, 1),
            block,
            &[b(0, 0), b(id, 0), b(id + 10, 0), i(cols), "f:1e-5".into()],
        );
        checks.push((
            format!("rms_norm_{dt}"),
            download(&om, n),
            s.save(id + 10),
            1e-5,
        ));
    }

    // RoPE over 5 rows of 4 heads of 22 dims (11 pairs), a table of 12 positions.
    let (heads, head_dim, positions) = (4usize, 22usize, [0u32, 5, 11, 2, 7]);
    let q: Vec<f32> = (0..rows * heads * head_dim)
        .map(|_| rng.symmetric_f32())
        .collect();
    let table: Vec<f32> = (0..12 * head_dim).map(|_| rng.symmetric_f32()).collect();
    let (mut qm, tm) = (
        cpu_put(&cpu, &f32_bytes(&q)),
        cpu_put(&cpu, &f32_bytes(&table)),
    );
    cpu.rope(&mut qm, rows, heads, head_dim, &positions, &tm);
    s.load(30, &f32_bytes(&q));
    s.load(31, &f32_bytes(&table));
    s.load(
        32,
        &positions
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    s.launch(
        "rope_f32",
        (rows, heads),
        head_dim / 2,
        &[b(30, 0), b(31, 0), b(32, 0), i(heads), i(head_dim)],
    );
    checks.push(("rope".into(), download(&qm, q.len()), s.save(30), 1e-6));

    // The elementwise ops, each on its own copy of x.
    type Op =
        fn(&CpuBackend, &mut sluice::backend::cpu::CpuMem, &sluice::backend::cpu::CpuMem, usize);
    let ops: [(&str, Op, Vec<String>); 5] = [
        ("silu_mul_f32", |c, g, u, n| c.silu_mul(g, u, n), vec![]),
        ("gelu_mul_f32", |c, g, u, n| c.gelu_mul(g, u, n), vec![]),
        (
            "swiglu_clamp_mul_f32",
            |c, g, u, n| c.swiglu_clamp_mul(g, u, n, 1.702, 2.5),
            vec!["f:1.702".into(), "f:2.5".into()],
        ),
        ("add_f32", |c, g, u, n| c.add(g, u, n), vec![]),
        ("scale_f32", |c, g, _, n| c.scale(g, 0.37, n), vec![]),
    ];
    for (k, (name, op, extra)) in ops.into_iter().enumerate() {
        let (mut gm, um) = (cpu_put(&cpu, &f32_bytes(&x)), cpu_put(&cpu, &f32_bytes(&y)));
        op(&cpu, &mut gm, &um, n);
        let id = 40 + k;
        s.load(id, &f32_bytes(&x));
        let args: Vec<String> = if name == "scale_f32" {
            vec![b(id, 0), "f:0.37".into(), i(n)]
        } else {
            [vec![b(id, 0), b(1, 0), i(n)], extra].concat()
        };
        s.launch(name, per_element, 256, &args);
        checks.push((name.into(), download(&gm, n), s.save(id), 1e-6));
    }

    // The bias add: out[r][c] + bias[c], one rounding.
    let bias: Vec<f32> = (0..cols).map(|_| rng.symmetric_f32()).collect();
    s.load(50, &f32_bytes(&x));
    s.load(51, &f32_bytes(&bias));
    s.launch(
        "add_bias_f32",
        per_element,
        256,
        &[b(50, 0), b(51, 0), i(rows), i(cols)],
    );
    let want: Vec<f32> = (0..n).map(|e| x[e] + bias[e % cols]).collect();
    checks.push(("add_bias_f32".into(), want, s.save(50), 0.0));

    // The KV-cache store: each row's K and V at its span's position and slot.
    for (k, kv) in [KvDtype::F32, KvDtype::F16].into_iter().enumerate() {
        let c = AttnCase::new(kv, (4, 2, 32), 40, Some(12), &mut rng);
        let width = 2 * 32;
        let kin: Vec<f32> = (0..c.rows * width).map(|_| rng.symmetric_f32()).collect();
        let vin: Vec<f32> = (0..c.rows * width).map(|_| rng.symmetric_f32()).collect();
        let step = AttnStep {
            layer: 0,
            spans: &c.spans,
            shape: c.shape,
            cache: c.cache,
            ancestors: &[],
        };
        let (km, vm) = (
            cpu_put(&cpu, &f32_bytes(&kin)),
            cpu_put(&cpu, &f32_bytes(&vin)),
        );
        let (mut ckm, mut cvm) = (cpu_put(&cpu, &c.k), cpu_put(&cpu, &c.v));
        cpu.kv_store(&km, &vm, &mut ckm, &mut cvm, &step);
        // Where the CUDA backend's metadata puts each row (`SpanRows`, what it uploads):
        // the kernel's cache must then hold the CPU backend's bits.
        let dst = SpanRows::of(&step).expect("span rows").kv_dst;
        let id = 60 + 10 * k;
        s.load(id, &f32_bytes(&kin));
        s.load(id + 1, &f32_bytes(&vin));
        s.load(id + 2, &c.k);
        s.load(id + 3, &c.v);
        s.load(
            id + 4,
            &dst.iter().flat_map(|d| d.to_le_bytes()).collect::<Vec<_>>(),
        );
        let kernel = match kv {
            KvDtype::F32 => "kv_store_f32",
            KvDtype::F16 => "kv_store_f16",
        };
        s.launch(
            kernel,
            (c.rows, 1),
            256,
            &[
                b(id, 0),
                b(id + 1, 0),
                b(id + 2, 0),
                b(id + 3, 0),
                b(id + 4, 0),
                i(width),
            ],
        );
        let words = c.k.len() / 4;
        checks.push((
            format!("{kernel} K"),
            download(&ckm, words),
            s.save(id + 2),
            0.0,
        ));
        checks.push((
            format!("{kernel} V"),
            download(&cvm, words),
            s.save(id + 3),
            0.0,
        ));
    }

    let out = s.run();
    for (what, want, at, tol) in checks {
        if tol == 0.0 {
            same_bits(&what, &out[at], &want);
        } else {
            close(&what, &want, &out[at], cols.min(want.len()), tol);
        }
    }
}

/// f16 bits to f32, exactly (test data).
fn f16_value(h: u16) -> f32 {
    let (sign, exp, mant) = ((h >> 15) & 1, ((h >> 10) & 31) as i32, (h & 1023) as f32);
    let mag = match exp {
        0 => mant * 2f32.powi(-24),
        31 => f32::INFINITY,
        e => (1024.0 + mant) * 2f32.powi(e - 25),
    };
    if sign == 1 {
        -mag
    } else {
        mag
    }
}

/// A mixture's kernels on the emulator: the routing against the host's (`Routes::route`,
/// both gatings, with and without renormalization, ties and a NaN logit), the row gather
/// and weighted scatter-add against the CPU backend, and the grouped form's bias add (f32,
/// f16, bf16 biases) and per-row combination against their definitions.
#[test]
fn mixture_kernels_match_the_host_and_the_cpu_backend() {
    use sluice::store::arch::{Gating, MoeConfig};
    let mut rng = Rng::new(23);
    let cpu = CpuBackend::new(64 << 20, 1).expect("cpu backend");
    let (rows, n, k) = (6usize, 60usize, 4usize);
    let mut logits: Vec<f32> = (0..rows * n).map(|_| rng.symmetric_f32() * 4.0).collect();
    logits[n + 7] = logits[n + 3]; // a tie: the lower expert first
    logits[2 * n + 5] = f32::NAN; // NaN ranks below every number
    let mut s = Script::new();
    s.load(0, &f32_bytes(&logits));
    let mut routes = Vec::new();
    for (c, (gating, norm)) in [
        (Gating::SoftmaxTopK, true),
        (Gating::SoftmaxTopK, false),
        (Gating::TopKSoftmax, false),
    ]
    .into_iter()
    .enumerate()
    {
        let (e, w) = (10 + 2 * c, 11 + 2 * c);
        s.zeros(e, rows * k * 4);
        s.zeros(w, rows * k * 4);
        s.launch(
            "router_topk_f32",
            (rows, 1),
            32,
            &[
                b(0, 0),
                b(e, 0),
                b(w, 0),
                i(n),
                i(k),
                i(usize::from(gating == Gating::TopKSoftmax)),
                i(usize::from(norm)),
                format!("smem:{}", n * 5),
            ],
        );
        routes.push((gating, norm, s.save(e), s.save(w)));
    }

    // Gather rows 5, 0, 3 of y; scatter them back weighted onto x.
    let cols = 300usize;
    let y: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric_f32()).collect();
    let x: Vec<f32> = (0..rows * cols).map(|_| rng.symmetric_f32()).collect();
    let picked = [5u32, 0, 3];
    let weights = [0.25f32, 0.7, -1.5];
    let u32s = |v: &[u32]| v.iter().flat_map(|r| r.to_le_bytes()).collect::<Vec<_>>();
    s.load(20, &f32_bytes(&y));
    s.load(21, &u32s(&picked));
    s.zeros(22, picked.len() * cols * 4);
    s.launch(
        "gather_rows_f32",
        (picked.len(), 1),
        256,
        &[b(20, 0), b(21, 0), b(22, 0), i(cols)],
    );
    let gathered = s.save(22);
    s.load(23, &f32_bytes(&x));
    s.load(24, &f32_bytes(&weights));
    s.launch(
        "scatter_add_rows_f32",
        (picked.len(), 1),
        256,
        &[b(22, 0), b(21, 0), b(24, 0), b(23, 0), i(cols)],
    );
    let scattered = s.save(23);

    // The grouped form: three pairs' outputs get their experts' biases (f32, f16, bf16),
    // then rows 4 and 1 get their pairs, weighted, in order.
    let pairs = 3usize;
    let out: Vec<f32> = (0..pairs * cols).map(|_| rng.symmetric_f32()).collect();
    let bias_f32: Vec<f32> = (0..cols).map(|_| rng.symmetric_f32()).collect();
    let bias_f16: Vec<u16> = (0..cols).map(|_| f16_bits(rng.symmetric_f32())).collect();
    let bias_bf16: Vec<u16> = (0..cols)
        .map(|_| (rng.symmetric_f32().to_bits() >> 16) as u16)
        .collect();
    let u16s = |v: &[u16]| v.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<_>>();
    s.load(30, &f32_bytes(&out));
    s.load(31, &f32_bytes(&bias_f32));
    s.load(32, &u16s(&bias_f16));
    s.load(33, &u16s(&bias_bf16));
    let mut with_bias = Vec::new();
    for (dtype, id) in [(0usize, 31usize), (1, 32), (2, 33)] {
        let o = 34 + dtype;
        s.load(o, &f32_bytes(&out));
        s.addrs(40 + dtype, &[b(id, 0), b(id, 0), b(id, 0)]);
        s.launch(
            "add_bias_grouped_f32",
            (pairs, 1),
            256,
            &[b(o, 0), b(40 + dtype, 0), i(dtype), i(cols)],
        );
        with_bias.push(s.save(o));
    }
    // Pairs 0 and 1 on step row 4, pair 2 on row 1 (pairs come expert-major); how the
    // kernel adds them, from the CUDA backend's own builder (`index_pairs`).
    let x_rows = [4u32, 4, 1];
    let (mut row_ids, mut starts, mut pair_ids) = (Vec::new(), Vec::new(), Vec::new());
    sluice::backend::cuda::index_pairs(
        &x_rows,
        &mut Vec::new(),
        (&mut row_ids, &mut starts, &mut pair_ids),
    );
    let pw = [0.5f32, -0.25, 2.0];
    s.load(50, &u32s(&row_ids));
    s.load(51, &u32s(&starts));
    s.load(52, &u32s(&pair_ids));
    s.load(53, &f32_bytes(&pw));
    s.load(54, &f32_bytes(&x));
    s.launch(
        "combine_rows_f32",
        (row_ids.len(), 1),
        256,
        &[
            b(30, 0),
            b(50, 0),
            b(51, 0),
            b(52, 0),
            b(53, 0),
            b(54, 0),
            i(cols),
        ],
    );
    let combined = s.save(54);
    let got = s.run();

    for (gating, norm, e, w) in routes {
        let moe = MoeConfig {
            n_experts: n as u32,
            top_k: k as u32,
            intermediate: 1,
            norm_topk_prob: norm,
            dense_layers: Vec::new(),
        };
        let mut host = sluice::model::moe::Routes::with_capacity(&moe, rows);
        host.route(&moe, gating, &logits, rows);
        for r in 0..rows {
            for (t, &(he, hw)) in host.chosen(r, k).iter().enumerate() {
                let (ge, gw) = (got[e][r * k + t].to_bits(), got[w][r * k + t]);
                assert_eq!(
                    ge, he,
                    "{gating:?} norm {norm}: row {r}, choice {t}: expert"
                );
                // A NaN logit makes a softmax row NaN on both sides.
                assert!(
                    (gw - hw).abs() <= 1e-6 * hw.abs().max(1e-3) || (gw.is_nan() && hw.is_nan()),
                    "{gating:?} norm {norm}: row {r}, choice {t}: weight {gw} vs the host's {hw}"
                );
            }
        }
    }
    let (ym, xm) = (cpu_put(&cpu, &f32_bytes(&y)), cpu_put(&cpu, &f32_bytes(&x)));
    let mut gm = cpu
        .alloc(picked.len() * cols * 4, "gathered")
        .expect("alloc");
    cpu.gather_rows(&ym, &picked, cols, &mut gm);
    let mut want = vec![0f32; picked.len() * cols];
    cpu.download_f32(&gm, 0, &mut want);
    same_bits("gather_rows_f32", &got[gathered], &want);
    let mut sm = xm;
    cpu.scatter_add_rows(&gm, &picked, &weights, cols, &mut sm);
    let mut want = vec![0f32; rows * cols];
    cpu.download_f32(&sm, 0, &mut want);
    cpu.check().expect("cpu ops");
    same_bits("scatter_add_rows_f32", &got[scattered], &want);
    let biases: [Vec<f32>; 3] = [
        bias_f32.clone(),
        bias_f16.iter().map(|&h| f16_value(h)).collect(),
        bias_bf16
            .iter()
            .map(|&h| f32::from_bits((h as u32) << 16))
            .collect(),
    ];
    for (dtype, bias) in biases.iter().enumerate() {
        let want: Vec<f32> = (0..pairs * cols).map(|e| out[e] + bias[e % cols]).collect();
        same_bits(
            &format!("add_bias_grouped_f32, dtype {dtype}"),
            &got[with_bias[dtype]],
            &want,
        );
    }
    // The CPU backend's order: expert by expert (pair by pair), each into its row.
    let mut want = x.clone();
    for (p, &row) in x_rows.iter().enumerate() {
        for c in 0..cols {
            let d = &mut want[row as usize * cols + c];
            *d += pw[p] * out[p * cols + c];
        }
    }
    same_bits("combine_rows_f32", &got[combined], &want);
}

/// The bf16 conversion of prefill activations for GemmEx, against the `half` crate's
/// (round to nearest even; NaN stays NaN, quieted; infinities and f32's range kept).
#[test]
fn the_bf16_conversion_matches_the_half_crate() {
    let mut rng = Rng::new(29);
    let mut x: Vec<f32> = (0..2000).map(|_| rng.symmetric_f32() * 1e3).collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001), // a signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        65504.0 * 4.0,
        f32::from_bits(0x3f80_8000), // halfway: to even
        f32::from_bits(0x3f81_8000), // halfway: to even, up
    ]);
    let mut s = Script::new();
    s.load(0, &f32_bytes(&x));
    s.zeros(1, x.len() * 2);
    s.launch(
        "f32_to_bf16",
        (x.len().div_ceil(256), 1),
        256,
        &[b(0, 0), b(1, 0), format!("u:{}", x.len())],
    );
    let at = s.save(1);
    let got = s.run();
    let bits: Vec<u16> = got[at]
        .iter()
        .flat_map(|w| {
            let b = w.to_bits();
            [b as u16, (b >> 16) as u16]
        })
        .collect();
    for (i, &v) in x.iter().enumerate() {
        let want = half::bf16::from_f32(v).to_bits();
        assert_eq!(bits[i], want, "{v:e} ({:#010x})", v.to_bits());
    }
}
