//! Speculative decoding's sampling is the model's own distribution: many seeded draws of a
//! sequence over a model small enough to enumerate (logits that depend on the last two
//! tokens, four tokens possible), with prompt-lookup drafts verified, against the exact
//! probabilities of every continuation (a chi-square test); and the same test fails when
//! verification is broken (rows given the logits of the wrong text), so it can fail.

use super::draft::{DraftConfig, DraftKind};
use super::sequence::{GenerateParams, SeqLimits, Sequence};
use super::test_model::{self, VOCAB};
use crate::model::TREE_ROOT;
use crate::text::{SamplingParams, Tokenizer};
use crate::util::rng::Rng;

/// The tokens the model can produce: bytes a, b, c, d.
const ALPHABET: [u32; 4] = [97, 98, 99, 100];
/// Tokens each sequence generates: 4^4 continuations.
const GENERATED: usize = 4;
const DRAWS: u64 = 40_000;

/// The model's logit for `t` after `x, y` (the last two tokens), in [-2, 2].
fn logit(x: u32, y: u32, t: u32) -> f32 {
    let mut r = Rng::new(u64::from(x) * 1_000_003 + u64::from(y) * 1009 + u64::from(t));
    2.0 * r.symmetric_f32()
}

/// The model's logits after `text`: the alphabet's, the rest of the vocabulary never.
fn logits(text: &[u32]) -> Vec<f32> {
    let (x, y) = (text[text.len() - 2], text[text.len() - 1]);
    let mut l = vec![-1e4f32; VOCAB as usize];
    for &t in &ALPHABET {
        l[t as usize] = logit(x, y, t);
    }
    l
}

/// The probability of each continuation (index: base-4 digits, first token most
/// significant) given the prompt.
fn exact(prompt: &[u32]) -> Vec<f64> {
    let mut p = vec![0.0; 4usize.pow(GENERATED as u32)];
    for (i, pi) in p.iter_mut().enumerate() {
        let mut text = prompt.to_vec();
        let mut prob = 1.0;
        for k in (0..GENERATED).rev() {
            let t = ALPHABET[(i / 4usize.pow(k as u32)) % 4];
            let l = logits(&text);
            let z: f64 = ALPHABET
                .iter()
                .map(|&a| f64::from(l[a as usize]).exp())
                .sum();
            prob *= f64::from(l[t as usize]).exp() / z;
            text.push(t);
        }
        *pi = prob;
    }
    p
}

/// How verification answers a drafted span's rows.
#[derive(Clone, Copy, PartialEq)]
enum Verify {
    /// Row j gets the logits of the text up to and including the span's token j.
    Right,
    /// Broken: rows after the first get the logits of the text without their own token.
    Broken,
    /// Broken for trees: a tree's rows get the logits of the span read as a chain (what
    /// attention that ignored the tree's mask would give).
    Chain,
}

/// One seeded sequence's draw: its continuation's index, the drafted and accepted tokens,
/// and the verified steps that were trees.
struct Draw {
    index: usize,
    drafted: u64,
    accepted: u64,
    trees: u64,
}

/// One seeded sequence driven to its end: its continuation's index, and the drafted and
/// accepted tokens.
fn draw(tok: &Tokenizer, prompt: &[u32], seed: u64, draft: Option<usize>, verify: Verify) -> Draw {
    let params = GenerateParams {
        max_tokens: GENERATED,
        sampling: SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        logit_bias: Vec::new(),
        format: Default::default(),
        draft: draft.map(|branches| DraftConfig {
            kind: DraftKind::Ngram,
            max: 3,
            fixed: false,
            branches,
        }),
        markers: false,
    };
    let limits = SeqLimits {
        max_context: 64,
        vocab: VOCAB,
    };
    let mut seq = Sequence::new(prompt.to_vec(), params, 0, limits).expect("valid");
    let mut trees = 0;
    while let Some(step) = seq.next_step(16) {
        let mut rows = Vec::new();
        let known = step.pos;
        let text: Vec<u32> = prompt
            .iter()
            .chain(seq.generated())
            .copied()
            .take(known)
            .collect();
        trees += u64::from(!step.parents.is_empty());
        for j in 0..step.logit_rows() {
            let last = step.tokens.len() - step.logit_rows() + j;
            let mut ctx = text.clone();
            // The row's text: its ancestors' tokens and its own (a chain: those before).
            let mut path = vec![last];
            while let Some(&p) = step.parents.get(path[0]).filter(|&&p| p != TREE_ROOT) {
                path.insert(0, p as usize);
            }
            if step.parents.is_empty() || verify == Verify::Chain {
                path = (0..=last).collect();
            }
            ctx.extend(path.iter().map(|&r| step.tokens[r]));
            if verify == Verify::Broken && j > 0 {
                ctx.pop();
            }
            rows.extend(logits(&ctx));
        }
        seq.advance(step.tokens.len(), &rows, tok, 0);
    }
    let index = seq.generated().iter().fold(0, |i, &t| {
        let d = ALPHABET
            .iter()
            .position(|&a| a == t)
            .expect("only the alphabet has a chance");
        i * 4 + d
    });
    let (drafted, accepted) = seq.drafted();
    Draw {
        index,
        drafted,
        accepted,
        trees,
    }
}

/// Pearson's chi-square of `counts` against `p` over `n` draws, and the statistic's
/// 0.1 % critical value for its degrees of freedom (Wilson-Hilferty).
fn chi_square(counts: &[u64], p: &[f64], n: u64) -> (f64, f64) {
    let stat = counts
        .iter()
        .zip(p)
        .map(|(&o, &e)| {
            let e = e * n as f64;
            (o as f64 - e).powi(2) / e
        })
        .sum();
    let k = (p.len() - 1) as f64;
    let z = 3.09;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
    (stat, critical)
}

#[test]
fn drafted_sampling_draws_the_models_exact_distribution_and_a_broken_rule_fails() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Tokenizer::from_manifest(store.manifest()).expect("tokenizer");
    // "abcabcabca": prompt lookup finds the pattern and drafts along it.
    let prompt: Vec<u32> = (0..10).map(|i| ALPHABET[i % 3]).collect();
    let p = exact(&prompt);
    assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    let mut counts = [
        vec![0u64; p.len()],
        vec![0u64; p.len()],
        vec![0u64; p.len()],
    ];
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..DRAWS {
        let plain = draw(&tok, &prompt, seed, None, Verify::Right).index;
        let Draw {
            index: spec,
            drafted: d,
            accepted: a,
            ..
        } = draw(&tok, &prompt, seed, Some(0), Verify::Right);
        let broken = draw(&tok, &prompt, seed, Some(0), Verify::Broken).index;
        // Each emitted token is the sampler's own draw: the same seed, the same text.
        assert_eq!(plain, spec, "seed {seed}");
        counts[0][plain] += 1;
        counts[1][spec] += 1;
        counts[2][broken] += 1;
        drafted += d;
        accepted += a;
    }
    let [(plain, crit), (spec, _), (broken, _)] =
        [0, 1, 2].map(|i| chi_square(&counts[i], &p, DRAWS));
    eprintln!(
        "chi-square over {} continuations, {DRAWS} draws: plain {plain:.1}, drafted {spec:.1}, broken verification {broken:.1}; 0.1 % critical value {crit:.1}; {accepted} of {drafted} drafted tokens accepted",
        p.len()
    );
    assert!(
        drafted > DRAWS && accepted > DRAWS / 4,
        "{accepted} of {drafted}"
    );
    assert!(
        plain < crit && spec < crit,
        "plain {plain}, drafted {spec}, critical {crit}"
    );
    assert!(
        broken > 2.0 * crit,
        "a broken rule went unseen: {broken} against {crit}"
    );
}

#[test]
fn tree_drafted_sampling_draws_the_models_exact_distribution_and_a_chain_reading_fails() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Tokenizer::from_manifest(store.manifest()).expect("tokenizer");
    // "abcabdabca": earlier occurrences of the text's end go on differently (after "a":
    // "bc", "bd"), so prompt lookup drafts trees.
    let prompt: Vec<u32> = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0].map(|i| ALPHABET[i]).to_vec();
    let p = exact(&prompt);
    let mut counts = [vec![0u64; p.len()], vec![0u64; p.len()]];
    let (mut drafted, mut accepted, mut trees) = (0, 0, 0);
    for seed in 0..DRAWS {
        let plain = draw(&tok, &prompt, seed, None, Verify::Right).index;
        let tree = draw(&tok, &prompt, seed, Some(3), Verify::Right);
        let chain = draw(&tok, &prompt, seed, Some(3), Verify::Chain).index;
        // Each emitted token is the sampler's own draw: the same seed, the same text.
        assert_eq!(plain, tree.index, "seed {seed}");
        counts[0][plain] += 1;
        counts[1][chain] += 1;
        drafted += tree.drafted;
        accepted += tree.accepted;
        trees += tree.trees;
    }
    let [(plain, crit), (chain, _)] = [0, 1].map(|i| chi_square(&counts[i], &p, DRAWS));
    eprintln!(
        "chi-square over {} continuations, {DRAWS} draws: plain and tree-drafted {plain:.1}, tree rows read as a chain {chain:.1}; 0.1 % critical value {crit:.1}; {trees} tree steps, {accepted} of {drafted} drafted tokens accepted",
        p.len()
    );
    assert!(
        trees > DRAWS / 4 && accepted > DRAWS / 4,
        "{trees} trees, {accepted} of {drafted}"
    );
    assert!(
        plain < crit,
        "plain and tree-drafted {plain}, critical {crit}"
    );
    assert!(
        chain > 2.0 * crit,
        "tree rows read as a chain went unseen: {chain} against {crit}"
    );
}
