//! Placement across backends (issue 60), its foundation: a model's decoder layers split
//! between two backends — the first layers on the host CPU, the rest on a discrete device
//! (here `CpuBackend::new_discrete`, which emulates one) — each backend's decoder holding
//! the KV cache of its own layers only (`Decoder::new_part`), the hidden state handed
//! across where the place changes. The logits must be those of one decoder over every
//! layer, bit for bit, through a prompt and decode steps (so the KV each side keeps is
//! read back), on every architecture.

use sluice::backend::cpu::CpuBackend;
use sluice::backend::{Backend, KvDtype};
use sluice::model::{Decoder, ModelOptions, SeqStep};
use sluice::store::Store;
use sluice_tests::*;

/// Every unit's raw bytes, decoded by the store's plain reader.
fn unit_bytes(store: &Store) -> Vec<Vec<u8>> {
    let file = store.open_weights().unwrap();
    let mut dec = store
        .frame_decoder(store.manifest().frame_raw_len_max() as usize)
        .unwrap();
    let mut stored = Vec::new();
    (0..store.units().len())
        .map(|i| {
            let mut raw = vec![0u8; store.units()[i].raw_len as usize];
            store
                .read_unit(&file, i, &mut stored, &mut raw, &mut dec)
                .unwrap();
            raw
        })
        .collect()
}

fn backend(discrete: bool, opts: &ModelOptions, store: &Store) -> CpuBackend {
    let b = if discrete {
        CpuBackend::new_discrete(1 << 30, 2)
    } else {
        CpuBackend::new(1 << 30, 2)
    }
    .unwrap();
    b.set_int8_activations(!opts.exact);
    b.reserve_scratch(&opts.scratch_shape(&store.manifest().arch));
    b
}

/// One side of a split: a backend, its decoder, and the weights of the units it runs.
struct Side {
    b: CpuBackend,
    model: Decoder<CpuBackend>,
    weights: Vec<Option<<CpuBackend as Backend>::Mem>>,
}

impl Side {
    fn new(
        store: &Store,
        raw: &[Vec<u8>],
        opts: ModelOptions,
        discrete: bool,
        layers: std::ops::Range<usize>,
        runs: impl Fn(usize) -> bool,
    ) -> Side {
        let b = backend(discrete, &opts, store);
        let model = Decoder::new_part(&b, store.manifest(), opts, layers).unwrap();
        let weights = raw
            .iter()
            .enumerate()
            .map(|(u, bytes)| {
                runs(u).then(|| {
                    let mut mem = b.alloc(bytes.len(), "weights").unwrap();
                    b.upload(&mut mem, bytes).unwrap();
                    mem
                })
            })
            .collect();
        Side { b, model, weights }
    }

    fn run(&mut self, u: usize, tied_head: Option<usize>) {
        let w = self.weights[u].as_ref().expect("a unit of this side");
        let lm = tied_head.map(|e| self.weights[e].as_ref().expect("the embedding"));
        self.model.forward_unit(&self.b, u, w, lm);
    }
}

/// Hands the hidden state from `from` to `to`.
fn hand(from: &Side, to: &mut Side) {
    let (x, n) = from.model.hidden();
    let mut h = vec![0f32; n];
    from.b.download_f32(x, 0, &mut h);
    let bytes: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
    to.b.upload(to.model.hidden_mut(), &bytes).unwrap();
}

/// The logits of each step: by one decoder over every layer (`host_layers` None), or with
/// decoder layers `0..host_layers` on the host and the rest on the device.
fn logits(store: &Store, host_layers: Option<usize>, steps: &[Vec<SeqStep>]) -> Vec<Vec<f32>> {
    let raw = unit_bytes(store);
    let m = store.manifest();
    let n_layers = m.arch.n_layers as usize;
    let opts = ModelOptions {
        max_context: 64,
        kv_slots: 2,
        max_batch_tokens: 32,
        kv_dtype: KvDtype::F32,
        exact: false,
        verify_rows: 0,
    };
    let n = raw.len();
    let split = host_layers.unwrap_or(0);
    let on_host = |u: usize| (1..=split).contains(&u);
    let mut dev = Side::new(store, &raw, opts, true, split..n_layers, |u| !on_host(u));
    let mut host = host_layers.map(|_| Side::new(store, &raw, opts, false, 0..split, on_host));
    let tied = m.arch.tied_embeddings.then_some(0);
    let mut out = Vec::new();
    for step in steps {
        dev.model.begin(step).unwrap();
        if let Some(h) = &mut host {
            h.model.begin(step).unwrap();
        }
        for u in 0..n {
            let head = (u == n - 1).then_some(tied).flatten();
            match &mut host {
                Some(h) if on_host(u) => {
                    if u == 1 {
                        hand(&dev, h);
                    }
                    h.run(u, None);
                    if u == split {
                        hand(h, &mut dev);
                    }
                }
                _ => dev.run(u, head),
            }
        }
        let mut l = Vec::new();
        dev.model.logits(&dev.b, &mut l);
        out.push(l);
    }
    out
}

/// A prompt of two sequences in chunks, then decode steps of both.
fn steps(vocab: u32) -> Vec<Vec<SeqStep>> {
    let step = |slot: usize, pos: usize, tokens: Vec<u32>, prompt: bool| SeqStep {
        slot,
        pos,
        tokens,
        verify: false,
        prompt,
        parents: Vec::new(),
        kv_moves: Vec::new(),
    };
    let ids = |k: u32, n: u32| (0..n).map(|i| (k * 31 + i * 7) % vocab).collect::<Vec<_>>();
    let mut s = vec![
        vec![step(0, 0, ids(1, 9), true), step(1, 0, ids(2, 5), true)],
        vec![step(0, 9, ids(3, 4), true)],
    ];
    for k in 0..6u32 {
        s.push(vec![
            step(0, 13 + k as usize, vec![(k * 13 + 3) % vocab], false),
            step(1, 5 + k as usize, vec![(k * 17 + 1) % vocab], false),
        ]);
    }
    s
}

#[test]
fn layers_on_the_host_give_the_logits_of_one_backend_on_every_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    for name in TINY_ARCHS {
        let store = pack_store(&fixture(name), &tmp.path().join(name), "zstd", 64 << 10);
        let n_layers = store.manifest().arch.n_layers as usize;
        let s = steps(store.manifest().arch.vocab);
        let one = logits(&store, None, &s);
        for split in [1, n_layers] {
            let got = logits(&store, Some(split), &s);
            for (i, (a, b)) in one.iter().zip(&got).enumerate() {
                assert!(
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name}: {split} layers on the host: step {i}'s logits differ"
                );
            }
        }
    }
}
