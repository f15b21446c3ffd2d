//! The prefix cache's blocks: `BLOCK_TOKENS` positions of a prompt's K and V, named by a
//! hash of their parent's name and their own tokens (vLLM's scheme), rooted in the model's
//! key: the store's manifest, the KV element type, `--exact`, the backend and the cache's
//! layout. A block is reused only under the same key, and its tokens and parent are stored
//! with it and checked, so a hash collision is a miss, never another text's KV. On disk a
//! block is a checksummed frame (`encode_frame`).

use crate::backend::{KvDtype, LayerCache};

/// Positions in a block.
pub const BLOCK_TOKENS: usize = 16;

/// The key every block of a model's KV is rooted in (see the module doc).
pub fn model_key(
    manifest: &[u8],
    (kv, exact): (KvDtype, bool),
    backend: &str,
    layers: &[LayerCache],
    position_bytes: usize,
) -> u64 {
    let mut b = Vec::with_capacity(64 + layers.len() * 16);
    b.extend_from_slice(&crate::util::xxh3(manifest).to_le_bytes());
    b.extend_from_slice(
        format!("{kv:?}/{exact}/{backend}/{BLOCK_TOKENS}/{position_bytes}").as_bytes(),
    );
    for l in layers {
        b.extend_from_slice(&(l.cap as u64).to_le_bytes());
        b.extend_from_slice(&(l.window.unwrap_or(0) as u64).to_le_bytes());
    }
    crate::util::xxh3(&b)
}

/// The name of the block of `tokens` whose parent is named `parent`.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut b = Vec::with_capacity(8 + tokens.len() * 4);
    b.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    crate::util::xxh3(&b)
}

/// The names of the first `n` whole blocks of `tokens`, under `key`.
pub fn chain(key: u64, tokens: &[u32], n: usize) -> Vec<u64> {
    let mut parent = key;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .take(n)
        .map(|t| {
            parent = block_hash(parent, t);
            parent
        })
        .collect()
}

/// A block's contents: its text, its parent's name, which layers it holds and their K and
/// V (`Decoder::export_kv`'s layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub held: Vec<bool>,
    pub bytes: Vec<u8>,
}

impl Block {
    /// Memory it takes (what the host budget counts).
    pub fn size(&self) -> u64 {
        (self.bytes.len() + self.tokens.len() * 4 + self.held.len() + 64) as u64
    }

    /// Whether it holds every layer `other` holds.
    pub fn covers(&self, other: &[bool]) -> bool {
        self.held.len() == other.len() && self.held.iter().zip(other).all(|(&a, &b)| a || !b)
    }

    /// Whether it is the block of `tokens` after `parent`.
    pub fn is_of(&self, parent: u64, tokens: &[u32]) -> bool {
        self.parent == parent && self.tokens == tokens
    }
}

/// Splits what `Decoder::export_kv` gave for `n` consecutive blocks whose `layers` held
/// layers are the same (per layer, the K rows of all their positions, then the V rows)
/// into each block's bytes (per layer, its K rows then its V rows).
pub fn split_run(bytes: &[u8], n: usize, layers: usize) -> Vec<Vec<u8>> {
    if layers == 0 || n == 0 {
        return vec![Vec::new(); n];
    }
    let per_layer = bytes.len() / layers;
    let (half, part) = (per_layer / 2, per_layer / 2 / n);
    (0..n)
        .map(|j| {
            let mut b = Vec::with_capacity(2 * layers * part);
            for k in 0..layers {
                let base = k * per_layer + j * part;
                b.extend_from_slice(&bytes[base..base + part]);
                b.extend_from_slice(&bytes[base + half..base + half + part]);
            }
            b
        })
        .collect()
}

/// The inverse of `split_run`: consecutive blocks' bytes (the same `layers` held layers)
/// as one run `Decoder::import_kv` writes at once.
pub fn join_run(blocks: &[&[u8]], layers: usize) -> Vec<u8> {
    let n = blocks.len();
    let total: usize = blocks.iter().map(|b| b.len()).sum();
    if layers == 0 || n == 0 {
        return Vec::new();
    }
    let part = total / n / layers / 2;
    let mut out = Vec::with_capacity(total);
    for k in 0..layers {
        for half in 0..2 {
            for b in blocks {
                let at = (2 * k + half) * part;
                out.extend_from_slice(&b[at..at + part]);
            }
        }
    }
    out
}

/// A block file's first bytes.
pub const FRAME_MAGIC: &[u8; 8] = b"SLKVBLK\0";
/// The block file format this build writes and reads.
pub const FRAME_VERSION: u32 = 1;
/// Bytes before the tokens: magic, version, tokens, layers, a pad, key, name, parent,
/// payload length, payload xxh3.
const FRAME_HEAD: usize = 8 + 4 * 4 + 8 * 5;

/// A block as a checksummed frame, padded to a multiple of 4096 bytes (read with O_DIRECT).
pub fn encode_frame(key: u64, hash: u64, b: &Block) -> Vec<u8> {
    let mut f = Vec::with_capacity(FRAME_HEAD + b.tokens.len() * 4 + b.bytes.len() + 4096);
    f.extend_from_slice(FRAME_MAGIC);
    for v in [FRAME_VERSION, b.tokens.len() as u32, b.held.len() as u32, 0] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    let sum = crate::util::xxh3(&b.bytes);
    for v in [key, hash, b.parent, b.bytes.len() as u64, sum] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    for t in &b.tokens {
        f.extend_from_slice(&t.to_le_bytes());
    }
    f.extend(b.held.iter().map(|&h| h as u8));
    let head_sum = crate::util::xxh3(&f);
    f.extend_from_slice(&head_sum.to_le_bytes());
    f.extend_from_slice(&b.bytes);
    f.resize(f.len().next_multiple_of(4096), 0);
    f
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Reads back a frame `encode_frame` wrote for `key` and `hash`: every field and both
/// checksums are checked; the error says which failed.
pub fn decode_frame(f: &[u8], key: u64, hash: u64) -> Result<Block, String> {
    if f.len() < FRAME_HEAD || &f[..8] != FRAME_MAGIC {
        return Err("not a sluice KV block (bad magic)".into());
    }
    let version = le_u32(f, 8);
    if version != FRAME_VERSION {
        return Err(format!(
            "written in block format {version}, this build reads {FRAME_VERSION}"
        ));
    }
    let (n, layers) = (le_u32(f, 12) as usize, le_u32(f, 16) as usize);
    let (fkey, fhash, parent, len) = (le_u64(f, 24), le_u64(f, 32), le_u64(f, 40), le_u64(f, 48));
    let sum = le_u64(f, 56);
    if fkey != key || fhash != hash {
        return Err(format!(
            "names block {fhash:016x} of model key {fkey:016x}, expected {hash:016x} of {key:016x}"
        ));
    }
    if n != BLOCK_TOKENS || layers > 1 << 16 {
        return Err(format!(
            "{n} tokens over {layers} layers: not this build's blocks"
        ));
    }
    let tokens_at = FRAME_HEAD;
    let held_at = tokens_at + n * 4;
    let head_end = held_at + layers;
    let payload_at = head_end + 8;
    let end = usize::try_from(len)
        .ok()
        .and_then(|l| payload_at.checked_add(l))
        .filter(|&e| e <= f.len())
        .ok_or_else(|| format!("truncated: {} bytes, the header says {len} of KV", f.len()))?;
    if crate::util::xxh3(&f[..head_end]) != le_u64(f, head_end) {
        return Err("header checksum mismatch".into());
    }
    let bytes = &f[payload_at..end];
    if crate::util::xxh3(bytes) != sum {
        return Err("KV checksum mismatch".into());
    }
    let tokens = (0..n).map(|i| le_u32(f, tokens_at + 4 * i)).collect();
    let held = f[held_at..head_end].iter().map(|&h| h != 0).collect();
    Ok(Block {
        parent,
        tokens,
        held,
        bytes: bytes.to_vec(),
    })
}

/// A block of `layers` layers (every other one held) and 1000 bytes of `fill` (tests).
#[cfg(test)]
pub(crate) fn test_block(fill: u8, layers: usize) -> Block {
    Block {
        parent: 7,
        tokens: (0..BLOCK_TOKENS as u32).collect(),
        held: (0..layers).map(|l| l % 2 == 0).collect(),
        bytes: vec![fill; 1000],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_reads_back_and_any_flipped_bit_or_cut_is_refused() {
        let b = test_block(3, 5);
        let f = encode_frame(11, 22, &b);
        assert_eq!(f.len() % 4096, 0);
        assert_eq!(decode_frame(&f, 11, 22), Ok(b));
        assert!(decode_frame(&f, 12, 22).is_err(), "another model's key");
        assert!(decode_frame(&f, 11, 23).is_err(), "another block's name");
        let payload_end = FRAME_HEAD + BLOCK_TOKENS * 4 + 5 + 8 + 1000;
        for at in (0..payload_end).step_by(7) {
            let mut g = f.clone();
            g[at] ^= 0x10;
            assert!(decode_frame(&g, 11, 22).is_err(), "bit flipped at {at}");
        }
        assert!(decode_frame(&f[..payload_end - 1], 11, 22).is_err());
        let mut old = f.clone();
        old[8] = 0;
        let e = decode_frame(&old, 11, 22).unwrap_err();
        assert!(e.contains("block format 0"), "{e}");
    }

    #[test]
    fn a_run_splits_into_blocks_and_joins_back() {
        // 3 blocks, 2 held layers, 4 bytes a position's K (or V) a layer... as bytes.
        let (n, layers, part) = (3, 2, 5);
        let run: Vec<u8> = (0..(2 * layers * n * part) as u32)
            .map(|v| v as u8)
            .collect();
        let blocks = split_run(&run, n, layers);
        // Block 1, layer 1's V: layer 1 starts at 2 * n * part, its V half n * part on.
        let v = 2 * n * part + n * part + part;
        assert_eq!(&blocks[1][3 * part..4 * part], &run[v..v + part]);
        let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
        assert_eq!(join_run(&refs, layers), run);
        assert_eq!(split_run(&[], 2, 0), vec![Vec::<u8>::new(); 2]);
    }

    #[test]
    fn names_chain_through_parents_and_the_key() {
        let t: Vec<u32> = (0..40).collect();
        let a = chain(1, &t, 2);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1], block_hash(a[0], &t[16..32]));
        assert_ne!(chain(2, &t, 2)[1], a[1], "another key names other blocks");
        let mut u = t.clone();
        u[3] = 99;
        assert_ne!(
            chain(1, &u, 2)[1],
            a[1],
            "a changed token renames every block after it"
        );
        assert_eq!(chain(1, &t, 9).len(), 2, "whole blocks only");
    }
}
