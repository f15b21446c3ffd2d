//! The float codec's tests: every layout and mode round-trips, through the portable and
//! the SIMD code paths, and damaged planes decode in bounds or fail.

use super::decode::MULTI_MIN;
use super::huffman::{code_lengths, MAX_LEN};
use super::plane::{sparse_bytes, OWN_CODE_SAVING_MIN, STREAMS};
use super::*;
use crate::util::rng::Rng;

/// One code for plane `plane` of `layout` from the summed symbol counts of its
/// frames; None for fewer than two symbols.
fn shared_code(layout: Layout, plane: usize, hist: &[u64; 256]) -> Option<SharedCode> {
    if hist.iter().filter(|&&c| c > 0).count() < 2 {
        return None;
    }
    Some(SharedCode::from_lens(layout, plane, &code_lengths(hist)))
}

/// Every plane of `raw` coded, decoded and joined back; returns the exponent plane's
/// coded bytes.
fn round_trip(layout: Layout, raw: &[u8]) -> usize {
    let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
    split(layout, raw, &mut planes);
    let n = raw.len() / layout.width();
    let mut back: [Vec<u8>; PLANES_MAX] = Default::default();
    let mut exp_bytes = 0;
    for i in 0..layout.planes() {
        let m = layout.plane_len(i, n);
        assert_eq!(planes[i].len(), m, "{layout:?} plane {i}");
        let mut coded = Vec::new();
        encode_plane(layout, &planes[i], &mut coded);
        assert_eq!(plane_layout(&coded), Ok(layout));
        back[i] = vec![0u8; m + 8];
        decode_plane(&coded, m, &mut back[i], &mut PlaneCache::default()).expect("decodes");
        assert_eq!(back[i][..m], planes[i][..], "{layout:?} plane {i}");
        let mut portable = vec![0u8; m + 8];
        let mut cache = PlaneCache::default();
        let none = SharedTables::default();
        decode_plane_as(&coded, m, &mut portable, &mut cache, &none, Simd::Portable)
            .expect("decodes");
        assert_eq!(
            portable[..m],
            planes[i][..],
            "{layout:?} plane {i}, portable"
        );
        back[i].truncate(m);
        if i == 0 {
            exp_bytes = coded.len();
        }
    }
    let mut out = vec![0u8; raw.len()];
    join(layout, back.each_ref().map(|b| &b[..]), &mut out);
    assert_eq!(out, raw, "{layout:?}, {} bytes", raw.len());
    let mut portable = vec![0u8; raw.len()];
    let planes = back.each_ref().map(|b| &b[..]);
    join_as(layout, planes, &mut portable, Simd::Portable);
    assert_eq!(portable, raw, "{layout:?}, {} bytes, portable", raw.len());
    exp_bytes
}

/// The project's generator from `seed`, as a closure.
fn random(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = Rng::new(seed);
    move || rng.next_u64()
}

fn gaussian_bf16(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut u = move || rng.unit_f64() as f32;
    (0..n)
        .flat_map(|_| {
            let v = (u() + u() + u() + u() - 2.0) * 0.02;
            ((v.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

#[test]
fn every_layout_round_trips_at_every_length_and_special_value() {
    let specials: [u32; 10] = [
        0x0000_0000,
        0x8000_0000, // -0
        0x0000_0001, // smallest denormal
        0x807f_ffff, // largest negative denormal
        0x7f80_0000, // inf
        0xff80_0000, // -inf
        0x7fc0_0001, // NaN with a payload
        0xffbf_ffff, // signalling NaN, negative
        0x3f80_0000,
        0xbf7f_ffff,
    ];
    for n in [
        0usize, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 95, 1000, 4099,
    ] {
        let mut rng = Rng::new(n as u64);
        let mut vals: Vec<u32> = (0..n)
            .map(|i| {
                let x = rng.next_u64();
                if i % 5 == 0 {
                    specials[(x % 10) as usize]
                } else {
                    (((x as f32 / u64::MAX as f32) - 0.5) * 0.1).to_bits()
                }
            })
            .collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        round_trip(Layout::F32, &f32s);
        round_trip(Layout::F32Top, &f32s);
        let halves: Vec<u8> = vals
            .iter()
            .flat_map(|v| ((v >> 16) as u16).to_le_bytes())
            .collect();
        round_trip(Layout::Bf16, &halves);
        round_trip(Layout::F16, &halves);
        round_trip(Layout::F16Bits, &halves);
        // Every element with one exponent (the constant mode).
        vals.iter_mut()
            .for_each(|v| *v = 0x3f80_0000 | (*v & 0x807f_ffff));
        let same: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        round_trip(Layout::F32, &same);
        round_trip(Layout::F32Top, &same);
    }
}

#[test]
fn f32_frames_of_a_skewed_mantissa_top_take_the_top_split() {
    // Norm vectors: values near a centre in bf16 precision, and the same plus one in
    // f32 (as Gemma's converter adds it: the middle byte carries a bit); the top
    // split then costs less than F32's sign-and-top-7 byte, or within half a bit.
    for (n, centre) in [(256, 1.0f32), (576, 1.5), (640, 2.5), (4099, 1.0)] {
        let raw = norm_f32(n, centre, n as u64);
        assert_eq!(f32_layout(&raw, 0.03), Layout::F32Top, "{n} near {centre}");
        let plus_one: Vec<u8> = raw
            .chunks_exact(4)
            .flat_map(|x| (f32::from_le_bytes(crate::util::array(x)) + 1.0).to_le_bytes())
            .collect();
        assert_eq!(
            f32_layout(&plus_one, 0.03),
            Layout::F32Top,
            "{n} near {centre} + 1"
        );
        round_trip(Layout::F32Top, &plus_one);
    }
    // Trained weights' mantissas are nearly random: F32 keeps its layout.
    let weights: Vec<u8> = gaussian_bf16(1 << 14, 4)
        .chunks_exact(2)
        .zip(gaussian_bf16(1 << 14, 5).chunks_exact(2))
        .flat_map(|(h, l)| [l[0], l[1], h[0], h[1]])
        .collect();
    assert_eq!(f32_layout(&weights, 0.03), Layout::F32);
    assert_eq!(f32_layout(&[], 0.03), Layout::F32);
}

#[test]
fn exponents_of_gaussian_weights_code_near_their_entropy() {
    let raw = gaussian_bf16(1 << 19, 3);
    let coded = round_trip(Layout::Bf16, &raw);
    let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
    split(Layout::Bf16, &raw, &mut planes);
    let e = &planes[0];
    let mut hist = [0u64; 256];
    e.iter().for_each(|&x| hist[x as usize] += 1);
    let n = e.len() as f64;
    let entropy: f64 = hist
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| -(c as f64 / n) * (c as f64 / n).log2())
        .sum();
    let bits = coded as f64 * 8.0 / n;
    assert!(
        bits < entropy + 0.05,
        "{bits:.3} bits an exponent for an entropy of {entropy:.3}"
    );
}

#[test]
fn a_skewed_histogram_keeps_codes_within_the_table() {
    // Fibonacci counts make Huffman's codes as long as the symbols are many.
    let mut hist = [0u64; 256];
    let (mut a, mut b) = (1u64, 1u64);
    for h in hist.iter_mut().take(40) {
        *h = a;
        (a, b) = (b, a + b);
    }
    let lens = code_lengths(&hist);
    assert!(lens.iter().all(|&l| l as u32 <= MAX_LEN));
    let kraft: f64 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 0.5f64.powi(l as i32))
        .sum();
    assert!((kraft - 1.0).abs() < 1e-12, "Kraft sum {kraft}");
    let exps: Vec<u8> = (0..40u8)
        .flat_map(|s| std::iter::repeat_n(s, (hist[s as usize] % 977) as usize + 1))
        .collect();
    let raw: Vec<u8> = exps.iter().flat_map(|&e| [0x55, e]).collect();
    round_trip(Layout::F16, &raw);
}

#[test]
fn one_cache_serves_planes_of_different_codes_and_lengths() {
    // Frames of one decoder come with their own codes: the cached tables are used only
    // for the same code, and rebuilt with the multi-symbol part when a long plane
    // follows a short one of the same code.
    let mut cache = PlaneCache::default();
    let mut out = vec![0u8; MULTI_MIN * 2 + 8];
    let long = gaussian_bf16(MULTI_MIN * 2, 5);
    let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
    split(Layout::Bf16, &long, &mut planes);
    let short = planes[0][..1000].to_vec();
    let other: Vec<u8> = planes[1].clone();
    // One code for both lengths: four symbols in turn, a 2-bit code each.
    let cycle = |n: usize| -> Vec<u8> { (0..n).map(|i| 120 + (i % 4) as u8).collect() };
    let (few, many) = (cycle(1000), cycle(MULTI_MIN + 100));
    let mut cases = Vec::new();
    for p in [&short, &planes[0], &other, &few, &many, &short, &planes[0]] {
        let mut coded = Vec::new();
        encode_plane(Layout::Bf16, p, &mut coded);
        cases.push((p.clone(), coded));
    }
    for (p, coded) in cases.iter().chain(cases.iter().rev()) {
        decode_plane(coded, p.len(), &mut out, &mut cache).expect("decodes");
        assert_eq!(&out[..p.len()], &p[..]);
    }
}

#[test]
fn long_planes_decode_with_the_table_that_pays_to_their_last_symbol() {
    // A skewed two-symbol plane packs five symbols a lookup; a plane of ~7-bit codes
    // (128 symbols in turn) packs one, so it decodes a symbol a lookup from the
    // small table. Lengths around MULTI_MIN and its multiples of 4 and 20 end the
    // streams' multi-symbol tails with 0 to 7 symbols left after the last whole word.
    let mut rand = random(0x2545_f491_4f6c_dd1d);
    let mut cache = PlaneCache::default();
    for n in (MULTI_MIN..MULTI_MIN + 9).chain([MULTI_MIN + 41, MULTI_MIN + 80, 3 * MULTI_MIN + 7]) {
        let skewed: Vec<u8> = (0..n)
            .map(|_| 60 + rand().is_multiple_of(10) as u8)
            .collect();
        let wide: Vec<u8> = (0..n)
            .map(|i| (i % 128) as u8 ^ (rand() % 2) as u8)
            .collect();
        for (plane, pays) in [(&skewed, true), (&wide, false)] {
            let mut coded = Vec::new();
            encode_plane(Layout::Bf16, plane, &mut coded);
            for simd in [Simd::Detect, Simd::Portable] {
                let mut out = vec![0xa5u8; n + 8];
                let none = SharedTables::default();
                decode_plane_as(&coded, n, &mut out, &mut cache, &none, simd).expect("decodes");
                assert_eq!(out[..n], plane[..], "n {n}, multi pays {pays}, {simd:?}");
                let t = cache.tables.as_ref().expect("tables");
                assert_eq!(t.multi_pays, pays, "n {n}");
            }
        }
    }
}

#[test]
fn streams_that_decode_at_different_rates_each_end_exactly() {
    // A plane of two parts, as a frame of several norm vectors is: one stream's
    // quarter nearly one symbol (five a lookup), the others' of sixteen symbols (about
    // two a lookup). The round loop then stops with the slow streams far from their
    // ends, and they go on interleaved without the fast one; each quarter must decode
    // to its own symbols and no stream may write into its neighbour's. Every position
    // of the fast quarter, shared codes (small planes) and own codes (long ones).
    let mut rand = random(0x9e37_79b9_7f4a_7c15);
    for n in [3072, 3077, MULTI_MIN + 5] {
        let q = n.div_ceil(STREAMS);
        for fast in 0..STREAMS {
            let plane: Vec<u8> = (0..n)
                .map(|i| match i / q == fast {
                    true => 60 + rand().is_multiple_of(16) as u8,
                    false => 40 + (rand() % 16) as u8,
                })
                .collect();
            let mut hist = [0u64; 256];
            plane.iter().for_each(|&b| hist[b as usize] += 1);
            let codes = vec![shared_code(Layout::Bf16, 0, &hist).expect("a code")];
            let shared = SharedTables::new(&codes).expect("checks");
            let mut coded = Vec::new();
            encode_plane_with(
                Layout::Bf16,
                0,
                &plane,
                &mut coded,
                &shared_encodings(&codes),
            );
            let mut own = Vec::new();
            encode_plane(Layout::Bf16, &plane, &mut own);
            for (coded, mode) in [(&coded, PlaneMode::Shared), (&own, PlaneMode::Huffman)] {
                assert_eq!(PlaneMode::try_from(coded[1]), Ok(mode), "n {n}");
                for simd in [Simd::Detect, Simd::Portable] {
                    let mut out = vec![0xa5u8; n + 8];
                    let mut cache = PlaneCache::default();
                    decode_plane_as(coded, n, &mut out, &mut cache, &shared, simd)
                        .expect("decodes");
                    assert_eq!(
                        out[..n],
                        plane[..],
                        "n {n}, fast stream {fast}, mode {mode:?}, {simd:?}"
                    );
                }
            }
        }
    }
}

/// Norm-vector-like f32 frames: values near `centre`, bf16 precision (the low planes
/// zero), as a GGUF's F32 norms are.
fn norm_f32(n: usize, centre: f32, seed: u64) -> Vec<u8> {
    let g = gaussian_bf16(n, seed);
    g.chunks_exact(2)
        .flat_map(|h| {
            let v = centre + f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16) * 20.0;
            (v.to_bits() & 0xffff_0000).to_le_bytes()
        })
        .collect()
}

#[test]
fn small_planes_name_a_shared_code_and_decode_with_the_store_tables() {
    // A census of 24 small frames of two kinds, as a store's norm vectors.
    let frames: Vec<Vec<u8>> = (0..24u64)
        .map(|i| norm_f32(576 + 64 * (i as usize % 3), [1.0, 0.2][i as usize % 2], i))
        .collect();
    let mut hist: Vec<[u64; 256]> = vec![[0; 256]; 4];
    let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
    for f in &frames {
        split(Layout::F32, f, &mut planes);
        for (h, p) in hist.iter_mut().zip(&planes) {
            p.iter().for_each(|&b| h[b as usize] += 1);
        }
    }
    // One code for all: the two low planes are all zeros, so none for them.
    let one: Vec<SharedCode> = (0..4)
        .filter_map(|i| shared_code(Layout::F32, i, &hist[i]))
        .collect();
    assert_eq!(one.len(), 2, "{one:?}");
    // Grouped: the frames near 1 and those near 0.2 get codes of their own kind.
    let per_frame = |i: usize| -> Vec<[u64; 256]> {
        frames
            .iter()
            .map(|f| {
                let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
                split(Layout::F32, f, &mut planes);
                let mut h = [0u64; 256];
                planes[i].iter().for_each(|&b| h[b as usize] += 1);
                h
            })
            .collect()
    };
    let codes: Vec<SharedCode> = (0..4)
        .flat_map(|i| shared_codes(Layout::F32, i, &per_frame(i)))
        .collect();
    assert!(
        codes.iter().all(|c| c.plane == 0 || c.plane == 3),
        "{codes:?}"
    );
    assert!(
        codes.len() > 2 && codes.len() <= 2 * SHARED_CODES_PER_PLANE,
        "{codes:?}"
    );
    assert_eq!(
        shared_codes(Layout::F32, 0, &per_frame(0)),
        shared_codes(Layout::F32, 0, &per_frame(0))
    );
    let enc = shared_encodings(&codes);
    let tables = SharedTables::new(&codes).expect("the census's codes check");
    let mut named = 0;
    for f in &frames {
        split(Layout::F32, f, &mut planes);
        for (i, p) in planes.iter().enumerate() {
            let mut coded = Vec::new();
            encode_plane_with(Layout::F32, i, p, &mut coded, &enc);
            named += usize::from(coded[1] == PlaneMode::Shared as u8);
            let mut own = Vec::new();
            encode_plane(Layout::F32, p, &mut own);
            // Never more than `OWN_CODE_SAVING_MIN` over a code of its own.
            assert!(coded.len() as u64 <= own.len() as u64 + OWN_CODE_SAVING_MIN);
            for simd in [Simd::Detect, Simd::Portable] {
                let mut out = vec![0u8; p.len() + 8];
                let mut cache = PlaneCache::default();
                decode_plane_as(&coded, p.len(), &mut out, &mut cache, &tables, simd)
                    .expect("decodes");
                assert_eq!(&out[..p.len()], &p[..], "plane {i}, {simd:?}");
            }
            if coded[1] == PlaneMode::Shared as u8 {
                // Without the store's tables: an error that says so.
                let mut out = vec![0u8; p.len() + 8];
                let e = decode_plane(&coded, p.len(), &mut out, &mut PlaneCache::default())
                    .expect_err("no shared tables");
                assert!(
                    matches!(e, FloatError::SharedCodeMissing { index: _, count: 0 }),
                    "{e}"
                );
            }
        }
    }
    // Both coded planes of every frame name a shared code.
    assert_eq!(named, 2 * frames.len());
    // A plane with a symbol the census never saw takes a code of its own.
    split(Layout::F32, &norm_f32(576, 1.0, 99), &mut planes);
    let mut p = planes[0].clone();
    let unseen = (0..=255u8)
        .find(|&s| hist[0][s as usize] == 0)
        .expect("a free symbol");
    p[7] = unseen;
    let mut coded = Vec::new();
    encode_plane_with(Layout::F32, 0, &p, &mut coded, &enc);
    assert_eq!(coded[1], PlaneMode::Huffman as u8);
    let mut out = vec![0u8; p.len() + 8];
    decode_plane_as(
        &coded,
        p.len(),
        &mut out,
        &mut PlaneCache::default(),
        &tables,
        Simd::Detect,
    )
    .expect("decodes");
    assert_eq!(&out[..p.len()], &p[..]);
    // Named for the wrong layout: refused.
    let mut wrong = Vec::new();
    encode_plane_with(Layout::F32, 3, &planes[3], &mut wrong, &enc);
    assert_eq!(wrong[1], PlaneMode::Shared as u8);
    wrong[0] = Layout::Bf16.tag();
    let e = decode_plane_as(
        &wrong,
        p.len(),
        &mut out,
        &mut PlaneCache::default(),
        &tables,
        Simd::Detect,
    )
    .expect_err("wrong layout");
    assert!(matches!(e, FloatError::SharedCodeLayout { .. }), "{e}");
}

#[test]
fn a_shared_code_that_does_not_check_is_refused() {
    let ok = SharedCode {
        layout: Layout::Bf16.tag(),
        plane: 0,
        lens: vec![(3, 1), (7, 2), (9, 2)],
    };
    assert!(ok.check().is_ok());
    let bad = [
        SharedCode {
            lens: vec![(3, 1), (7, 2)],
            ..ok.clone()
        },
        SharedCode {
            lens: vec![(3, 1), (3, 2), (9, 2)],
            ..ok.clone()
        },
        SharedCode {
            lens: vec![(3, 1), (7, 2), (9, 12)],
            ..ok.clone()
        },
        SharedCode {
            lens: vec![(3, 0), (7, 1), (9, 1)],
            ..ok.clone()
        },
        SharedCode {
            lens: vec![(3, 1)],
            ..ok.clone()
        },
        SharedCode {
            layout: 9,
            ..ok.clone()
        },
        SharedCode {
            plane: 2,
            ..ok.clone()
        },
    ];
    for c in &bad {
        assert!(c.check().is_err(), "{c:?}");
        assert!(SharedTables::new(std::slice::from_ref(c)).is_err(), "{c:?}");
    }
}

#[test]
fn damaged_planes_decode_in_bounds_or_fail() {
    // Both decoders: a symbol a lookup (short planes) and several (long ones).
    for n in [3000, MULTI_MIN + 3001] {
        damaged(n);
    }
}

#[test]
fn planes_of_few_exceptions_code_sparse_and_round_trip() {
    // Exceptions at the ends, gaps on either side of the skip byte, a run of them, and
    // a base symbol that is not zero.
    let n = 3000;
    let cases: [(u8, &[usize]); 4] = [
        (0, &[0, 1, 2, 254, 510, 765, 766, 1021, 2999]),
        (0x40, &[255, 256, 1000, 1001, 1002, 2998]),
        (7, &[2999]),
        (0, &[0]),
    ];
    for (base, at) in cases {
        let mut plane = vec![base; n];
        for (k, &i) in at.iter().enumerate() {
            plane[i] = base ^ (1 + k as u8);
        }
        let mut coded = Vec::new();
        encode_plane(Layout::F32, &plane, &mut coded);
        assert_eq!(
            coded[1],
            PlaneMode::Sparse as u8,
            "mode of a plane with {} exceptions",
            at.len()
        );
        assert_eq!(coded.len() as u64, 1 + sparse_bytes(&plane, base));
        let mut out = vec![0xaau8; n + 8];
        decode_plane(&coded, n, &mut out, &mut PlaneCache::default()).expect("decodes");
        assert_eq!(out[..n], plane[..], "base {base}, exceptions {at:?}");
    }
    // Where the exceptions are many, the Huffman code is the smaller and is kept.
    let dense: Vec<u8> = (0..n).map(|i| (i % 3 == 0) as u8).collect();
    let mut coded = Vec::new();
    encode_plane(Layout::F32, &dense, &mut coded);
    assert_eq!(coded[1], PlaneMode::Huffman as u8);
    // An exception past the plane's end, or cut in half, is refused.
    let mut out = vec![0u8; 16 + 8];
    for bad in [
        &[5u8, 3, 0, 16, 1][..],
        &[5, 3, 0, 2],
        &[5, 3, 0, 255, 0, 1],
    ] {
        let err = decode_plane(bad, 16, &mut out, &mut PlaneCache::default());
        assert!(err.is_err(), "{bad:?} decoded");
    }
    let at_end = decode_plane(&[5, 3, 0, 15, 9], 16, &mut out, &mut PlaneCache::default());
    assert_eq!(at_end, Ok(()));
    assert_eq!(out[..16], [&[0u8; 15][..], &[9]].concat());
    // Damaged sparse planes decode in bounds or fail.
    let mut plane = vec![0u8; n];
    (0..n).step_by(37).for_each(|i| plane[i] = i as u8 | 1);
    encode_plane(Layout::F32, &plane, &mut coded);
    assert_eq!(coded[1], PlaneMode::Sparse as u8);
    damage(&coded, n, &SharedTables::default());
}

fn damaged(n: usize) {
    let raw = gaussian_bf16(n, 9);
    let (mut planes, mut coded): ([Vec<u8>; PLANES_MAX], _) = (Default::default(), Vec::new());
    split(Layout::Bf16, &raw, &mut planes);
    encode_plane(Layout::Bf16, &planes[0], &mut coded);
    damage(&coded, n, &SharedTables::default());
    // A plane naming a shared code (mode 2), decoded with the tables.
    let mut hist = [0u64; 256];
    planes[1].iter().for_each(|&b| hist[b as usize] += 1);
    let codes = vec![shared_code(Layout::Bf16, 1, &hist).expect("a code")];
    encode_plane_with(
        Layout::Bf16,
        1,
        &planes[1],
        &mut coded,
        &shared_encodings(&codes),
    );
    assert_eq!(coded[1], PlaneMode::Shared as u8);
    damage(&coded, n, &SharedTables::new(&codes).expect("checks"));
}

fn damage(coded: &[u8], n: usize, shared: &SharedTables) {
    let mut rng = Rng::new(0x1234_5678);
    let (mut out, mut cache) = (vec![0u8; n + 8], PlaneCache::default());
    for round in 0..1500 {
        let x = rng.next_u64();
        let mut bad = coded.to_vec();
        match round % 3 {
            0 => {
                let at = x as usize % bad.len();
                bad[at] ^= 1 << ((x >> 32) % 8);
            }
            1 => bad.truncate(x as usize % bad.len()),
            _ => bad
                .iter_mut()
                .skip(x as usize % 16)
                .for_each(|b| *b = rng.next_u64() as u8),
        }
        // Wrong bytes or an error, never a panic or a read past a buffer.
        let _ = decode_plane_as(&bad, n, &mut out, &mut cache, shared, Simd::Detect);
    }
}

#[test]
fn plane_modes_are_their_bytes_on_disk_and_an_unknown_one_is_refused() {
    let modes = [
        (PlaneMode::Huffman, 0u8),
        (PlaneMode::Constant, 1),
        (PlaneMode::Shared, 2),
        (PlaneMode::Sparse, 3),
    ];
    for (mode, byte) in modes {
        assert_eq!(mode as u8, byte);
        assert_eq!(PlaneMode::try_from(byte), Ok(mode));
    }
    for byte in [4u8, 7, 255] {
        assert_eq!(
            PlaneMode::try_from(byte),
            Err(FloatError::UnknownMode { mode: byte })
        );
    }
    let mut out = [0u8; 16 + 8];
    let plane = [Layout::Bf16.tag(), 7, 0];
    let e = decode_plane(&plane, 16, &mut out, &mut PlaneCache::default()).expect_err("mode 7");
    assert_eq!(e.to_string(), "unknown mode 7");
}
