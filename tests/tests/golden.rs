//! Stores written by earlier versions of sluice (`tests/fixtures/golden/NAME/`, each made by
//! `scripts/make-golden-stores.sh` with the `sluiced` of the commit its `made-by.txt`
//! names): they open with today's reader, every frame decodes and checks against the
//! checksum the old writer stored, every unit decodes to the bytes recorded when the
//! store was made (`checksums.json`: xxh3-64 of each unit's decoded bytes), the stores of
//! one source decode to the same tensor bytes whatever their codec and version, and the
//! tensors of a store packed from a safetensors directory are the directory's own bytes
//! (read with the `safetensors` crate).
//!
//! `SLUICE_GOLDEN_BLESS=1` writes `checksums.json` for a store that has none (a new
//! golden store); one that has them is never rewritten.

use sluice::store::Store;
use sluice_tests::fixture;
use std::collections::BTreeMap;

/// A golden store: its directory under tests/fixtures/golden (named for its version and
/// codec), the format version its manifest must carry, and its source fixture.
struct Golden {
    name: &'static str,
    version: u32,
    source: &'static str,
}

const GOLDEN: &[Golden] = &[
    Golden {
        name: "v1-none",
        version: 1,
        source: "tiny-llama",
    },
    Golden {
        name: "v1-lz4",
        version: 1,
        source: "tiny-llama",
    },
    Golden {
        name: "v1-zstd-q",
        version: 1,
        source: "tiny-llama-q.gguf",
    },
    Golden {
        name: "v5-float",
        version: 5,
        source: "tiny-llama",
    },
    Golden {
        name: "v6-zstd-q",
        version: 6,
        source: "tiny-llama-q.gguf",
    },
    Golden {
        name: "v7-float-f16",
        version: 7,
        source: "tiny-llama.gguf",
    },
    Golden {
        name: "v9-float",
        version: 9,
        source: "tiny-llama",
    },
];

fn golden_dir(name: &str) -> std::path::PathBuf {
    fixture("golden").join(name)
}

/// Every unit of `store` decoded (its frames checked against their stored checksums).
fn decoded_units(store: &Store) -> Vec<Vec<u8>> {
    let file = store.open_weights().expect("weights.bin");
    let max = store.manifest().frame_raw_len_max() as usize;
    let mut dec = store.frame_decoder(max).expect("decoder");
    let mut stored = Vec::new();
    (0..store.units().len())
        .map(|u| {
            let mut raw = vec![0u8; store.units()[u].raw_len as usize];
            store
                .read_unit(&file, u, &mut stored, &mut raw, &mut dec)
                .unwrap_or_else(|e| panic!("{}: unit {u}: {e}", store.dir().display()));
            raw
        })
        .collect()
}

/// Each tensor's decoded bytes, by name.
type Tensors = BTreeMap<String, Vec<u8>>;

fn tensors(store: &Store, units: &[Vec<u8>]) -> Tensors {
    let mut out = BTreeMap::new();
    for (u, unit) in store.units().iter().enumerate() {
        for t in &unit.tensors {
            let (at, len) = (t.offset as usize, t.len as usize);
            out.insert(t.name.clone(), units[u][at..at + len].to_vec());
        }
    }
    out
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

#[test]
fn stores_of_earlier_versions_decode_to_the_bytes_they_held() {
    let mut by_source: BTreeMap<&str, Vec<(&str, Tensors)>> = BTreeMap::new();
    for g in GOLDEN {
        let dir = golden_dir(g.name);
        let store = Store::open(&dir).unwrap_or_else(|e| panic!("{}: {e}", g.name));
        let raw = std::fs::read(dir.join("manifest.bin")).expect("manifest.bin");
        let version = u32::from_le_bytes(raw[8..12].try_into().expect("4 bytes"));
        assert_eq!(version, g.version, "{}: format version", g.name);
        let units = decoded_units(&store);
        let sums: Vec<String> = units
            .iter()
            .map(|u| hex(xxhash_rust::xxh3::xxh3_64(u)))
            .collect();
        let path = dir.join("checksums.json");
        if !path.exists() && std::env::var_os("SLUICE_GOLDEN_BLESS").is_some() {
            let text = serde_json::to_string_pretty(&serde_json::json!({ "units": sums }));
            std::fs::write(&path, text.expect("json") + "\n").expect("write checksums.json");
        }
        let want: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap_or_else(|e| {
                panic!("{}: {e} (SLUICE_GOLDEN_BLESS=1 makes it)", path.display())
            }))
            .expect("checksums.json");
        let want: Vec<String> = want["units"]
            .as_array()
            .expect("units")
            .iter()
            .map(|s| s.as_str().expect("hex").to_string())
            .collect();
        assert_eq!(sums, want, "{}: decoded units", g.name);
        by_source
            .entry(g.source)
            .or_default()
            .push((g.name, tensors(&store, &units)));
    }
    // One source, many codecs and versions: the same tensor bytes.
    for (source, stores) in &by_source {
        let (first, want) = &stores[0];
        for (name, got) in &stores[1..] {
            assert!(
                got == want,
                "{name} and {first} (both from {source}) differ"
            );
        }
    }
    // A safetensors source's tensors are stored as the directory holds them.
    let st = by_source.get("tiny-llama").expect("tiny-llama goldens");
    let dir = fixture("tiny-llama");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("fixture") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).expect("safetensors file");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        for (name, view) in file.tensors() {
            let got = st[0]
                .1
                .get(&name)
                .unwrap_or_else(|| panic!("{name} not stored"));
            assert!(got.as_slice() == view.data(), "{name}: stored bytes differ");
            checked += 1;
        }
    }
    assert_eq!(checked, st[0].1.len(), "every stored tensor checked");
}
