//! The attention kernels' tests (`kernels.rs`): the grouped and four-row forms against f64
//! references and against the one-head, one-key forms, bit for bit.

use super::kernels::*;
use crate::backend::cpu::tests::rand_vec;

/// The grouped f16 attention kernels: a head's scores and weighted sums are the same
/// bits whether it runs alone or with up to three other heads, and a score's bits do not
/// depend on how many keys there are (the last group of keys is padded); both match f64.
#[test]
fn grouped_attention_kernels_match_f64_and_do_not_depend_on_the_grouping() {
    if !has_group_f16(64) {
        eprintln!("SKIPPED: no AVX2 on this CPU");
        return;
    }
    let (hd, heads, keys) = (64usize, 4usize, 23usize);
    let f16s = |v: Vec<f32>| -> Vec<u16> {
        v.iter()
            .map(|&x| half::f16::from_f32(x).to_bits())
            .collect()
    };
    let (ks, vs) = (
        f16s(rand_vec(keys * 2 * hd, 21)),
        f16s(rand_vec(keys * 2 * hd, 22)),
    );
    let q = rand_vec(heads * hd, 23);
    // Every other row of a two-head-wide cache, as the KV heads of a layer sit.
    let ats: Vec<usize> = (0..keys).map(|j| j * 2 * hd + hd).collect();
    let mut all = vec![0f32; heads * keys];
    group_scores_f16(&q, hd, &ks, &ats, &mut all);
    let kf = |j: usize, d: usize| half::f16::from_bits(ks[ats[j] + d]).to_f32() as f64;
    for h in 0..heads {
        let mut one = vec![0f32; keys];
        group_scores_f16(&q[h * hd..(h + 1) * hd], hd, &ks, &ats, &mut one);
        for j in 0..keys {
            assert_eq!(
                one[j].to_bits(),
                all[h * keys + j].to_bits(),
                "head {h} key {j}"
            );
            let want: f64 = (0..hd).map(|d| q[h * hd + d] as f64 * kf(j, d)).sum();
            assert!(
                (one[j] as f64 - want).abs() <= 1e-4,
                "head {h} key {j}: {} vs {want}",
                one[j]
            );
        }
        // Fewer keys: the scores of the keys kept are the same bits.
        for n in [1, 2, 5, 22] {
            let mut part = vec![0f32; n];
            group_scores_f16(&q[h * hd..(h + 1) * hd], hd, &ks, &ats[..n], &mut part);
            for j in 0..n {
                assert_eq!(
                    part[j].to_bits(),
                    one[j].to_bits(),
                    "head {h} key {j} of {n}"
                );
            }
        }
    }
    let p = rand_vec(heads * keys, 24);
    let mut o = vec![0f32; heads * hd];
    group_pv_f16(&p, hd, &vs, &ats, &mut o);
    for h in 0..heads {
        let mut one = vec![0f32; hd];
        group_pv_f16(&p[h * keys..(h + 1) * keys], hd, &vs, &ats, &mut one);
        for d in 0..hd {
            assert_eq!(
                one[d].to_bits(),
                o[h * hd + d].to_bits(),
                "head {h} dim {d}"
            );
            let want: f64 = (0..keys)
                .map(|j| {
                    p[h * keys + j] as f64 * half::f16::from_bits(vs[ats[j] + d]).to_f32() as f64
                })
                .sum();
            assert!(
                (one[d] as f64 - want).abs() <= 1e-4,
                "head {h} dim {d}: {} vs {want}",
                one[d]
            );
        }
    }
}

/// `--exact`'s f32 attention kernels: four keys at a time give each key the bits of
/// the one-key scalar forms (the lanes' products then sums, no FMA, summed in order),
/// at head dimensions with and without a tail past the last 8; four value rows added
/// at once are four one-row additions in order.
#[test]
fn four_f32_keys_at_once_are_the_bits_of_one_at_a_time() {
    // The scalar forms, written out as the f32 cache's attention had them.
    let dot = |q: &[f32], k: &[f32]| -> f32 {
        let mut acc = [0f32; 8];
        for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += qc[l] * kc[l];
            }
        }
        let mut d: f32 = acc.iter().sum();
        for i in q.len() / 8 * 8..q.len() {
            d += q[i] * k[i];
        }
        d
    };
    for hd in [4usize, 8, 64, 72, 128, 100] {
        let q = rand_vec(hd, hd as u64);
        let kv = rand_vec(hd * 9 + 3, 7 + hd as u64);
        let at = [3 * hd + 1, 0, 8 * hd + 3, hd];
        let four = dot4_f32(&q, &kv, at);
        for r in 0..4 {
            let want = dot(&q, &kv[at[r]..at[r] + hd]);
            assert_eq!(four[r].to_bits(), want.to_bits(), "hd {hd} key {r}");
            assert_eq!(
                dot_f32(&q, &kv[at[r]..at[r] + hd]).to_bits(),
                want.to_bits()
            );
        }
        let w = [0.25f32, -1.5, 3.0e-3, 0.7];
        let mut o4 = rand_vec(hd, 99);
        let mut o1 = o4.clone();
        axpy4_f32(w, &kv, at, &mut o4);
        for r in 0..4 {
            for (o, &v) in o1.iter_mut().zip(&kv[at[r]..at[r] + hd]) {
                *o += w[r] * v;
            }
        }
        assert_eq!(
            o4.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "hd {hd}"
        );
    }
}

/// The grouped f32 kernels (`--exact`'s attention, a KV head at a time) give every
/// score `dot_f32`'s bits and every output `axpy_f32`'s key after key, for one to six
/// heads (across GROUP_MAX), key counts around the four-key step, scattered keys and a
/// row stride wider than the keys.
#[test]
fn grouped_f32_attention_is_the_bits_of_a_head_at_a_time() {
    for hd in [8usize, 64, 128] {
        let kv = rand_vec(hd * 40, hd as u64);
        for heads in 1..=6 {
            let q = rand_vec(heads * hd, 3 + heads as u64);
            for n in [1usize, 3, 4, 5, 9, 17] {
                let ats: Vec<usize> = (0..n).map(|j| (j * 7 % 37) * hd + j % 3).collect();
                let stride = n + 5;
                let mut sc = vec![f32::NAN; heads * stride];
                group_scores_f32(&q, hd, &kv, &ats, &mut sc, stride);
                let p = rand_vec(heads * stride, 11 + n as u64);
                let mut o = rand_vec(heads * hd, 5);
                let mut want_o = o.clone();
                group_pv_f32(&p, stride, hd, &kv, &ats, &mut o);
                for h in 0..heads {
                    for (j, &a) in ats.iter().enumerate() {
                        let want = dot_f32(&q[h * hd..(h + 1) * hd], &kv[a..a + hd]);
                        assert_eq!(
                            sc[h * stride + j].to_bits(),
                            want.to_bits(),
                            "hd {hd} heads {heads} head {h} key {j} of {n}"
                        );
                        axpy_f32(
                            p[h * stride + j],
                            &kv[a..a + hd],
                            &mut want_o[h * hd..(h + 1) * hd],
                        );
                    }
                    assert!(sc[h * stride + n..(h + 1) * stride]
                        .iter()
                        .all(|x| x.is_nan()));
                }
                assert_eq!(
                    o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want_o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "hd {hd} heads {heads} n {n}"
                );
            }
        }
    }
}
