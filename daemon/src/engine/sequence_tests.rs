//! The sequence state machine on scripted logits: chunked prefill, the order of the
//! finish rules, and what `close` releases.

use super::sequence::{validate, Finish, GenerateParams, Piece, SeqLimits, Sequence};
use super::test_model::{self, END_TOKEN, VOCAB};
use crate::text::Tokenizer;

fn params(max_tokens: usize, stop: &[&str]) -> GenerateParams {
    test_model::greedy(max_tokens, stop, false)
}

const LIMITS: SeqLimits = SeqLimits {
    max_context: 16,
    vocab: VOCAB,
};

/// Logits whose argmax is `token`.
fn peak(token: u32) -> Vec<f32> {
    let mut l = vec![0.0; VOCAB as usize];
    l[token as usize] = 10.0;
    l
}

fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Tokenizer::from_manifest(store.manifest()).expect("tokenizer");
    (tmp, tok)
}

/// Runs the sequence's steps, answering each with logits peaked at the next of `script`.
fn drive(seq: &mut Sequence, tok: &Tokenizer, budget: usize, script: &[u32]) -> String {
    let mut text = String::new();
    let mut next = script.iter();
    while let Some(step) = seq.next_step(budget) {
        let done_prefill = seq.is_decoding() || step.pos + step.tokens.len() >= seq.prompt().len();
        let logits = if done_prefill {
            peak(*next.next().expect("the script covers every sampled token"))
        } else {
            vec![0.0; VOCAB as usize]
        };
        if let Some(Piece { text: t, .. }) = seq.advance(step.tokens.len(), &logits, tok, 0) {
            text.push_str(&t);
        }
    }
    text
}

#[test]
fn prompts_prefill_in_budgeted_chunks_then_decode_one_token_a_step() {
    let (_tmp, tok) = tokenizer();
    let mut seq = Sequence::new(
        b"hello".iter().map(|&b| b as u32).collect(),
        params(4, &[]),
        3,
        LIMITS,
    )
    .expect("valid");
    let mut shapes = Vec::new();
    let mut text = String::new();
    let script = [b'a' as u32, b'b' as u32, b'c' as u32, b'd' as u32];
    let mut next = script.iter();
    while let Some(step) = seq.next_step(2) {
        assert_eq!(step.slot, 3);
        shapes.push((step.pos, step.tokens.clone()));
        let sampled = seq.is_decoding() || step.pos + step.tokens.len() == 5;
        let logits = if sampled {
            peak(*next.next().unwrap())
        } else {
            vec![0.0; VOCAB as usize]
        };
        if let Some(p) = seq.advance(step.tokens.len(), &logits, &tok, 0) {
            text.push_str(&p.text);
        }
    }
    let h = |s: &[u8]| s.iter().map(|&b| b as u32).collect::<Vec<u32>>();
    assert_eq!(
        shapes,
        vec![
            (0, h(b"he")),
            (2, h(b"ll")),
            (4, h(b"o")),
            (5, h(b"a")),
            (6, h(b"b")),
            (7, h(b"c")),
        ]
    );
    assert_eq!(seq.finished(), Some(Finish::Length));
    assert_eq!(seq.decode_steps(), 3);
    let (tail, done) = seq.close(Finish::Length, &tok);
    assert_eq!(text + &tail.map(|p| p.text).unwrap_or_default(), "abcd");
    assert_eq!(done.generated_token_ids, h(b"abcd"));
    assert_eq!(done.finish, Finish::Length);
}

#[test]
fn an_end_token_stops_before_a_stop_string_and_gives_no_text() {
    let (_tmp, tok) = tokenizer();
    let mut seq = Sequence::new(vec![1, 2], params(10, &["x"]), 0, LIMITS).expect("valid");
    let text = drive(&mut seq, &tok, 8, &[b'o' as u32, b'k' as u32, END_TOKEN]);
    assert_eq!(seq.finished(), Some(Finish::Stop));
    let (tail, done) = seq.close(Finish::Length, &tok);
    // The end token's id still goes out with the last piece; it has no text.
    assert_eq!(text, "ok");
    assert_eq!(
        tail,
        Some(Piece {
            text: String::new(),
            token_ids: vec![END_TOKEN],
            logprobs: Vec::new(),
        })
    );
    assert_eq!(done.finish, Finish::Stop);
    assert_eq!(done.generated_token_ids.last(), Some(&END_TOKEN));
}

#[test]
fn a_stop_string_ends_the_text_before_it_and_releases_nothing_after() {
    let (_tmp, tok) = tokenizer();
    let mut seq = Sequence::new(vec![1], params(10, &["</s>"]), 0, LIMITS).expect("valid");
    let script: Vec<u32> = b"hi</s>zz".iter().map(|&b| b as u32).collect();
    let text = drive(&mut seq, &tok, 8, &script);
    assert_eq!(seq.finished(), Some(Finish::StopString));
    let (tail, done) = seq.close(Finish::Length, &tok);
    assert_eq!(text, "hi");
    assert_eq!(tail, None);
    assert_eq!(
        done.generated_token_ids.len(),
        6,
        "sampling stops at the stop string"
    );
}

#[test]
fn text_held_back_for_a_possible_stop_string_is_released_at_the_end() {
    let (_tmp, tok) = tokenizer();
    let mut seq = Sequence::new(vec![1], params(3, &["abz"]), 0, LIMITS).expect("valid");
    let text = drive(&mut seq, &tok, 8, &[b'x' as u32, b'a' as u32, b'b' as u32]);
    assert_eq!(seq.finished(), Some(Finish::Length));
    assert_eq!(text, "x", "\"ab\" may begin the stop string: held back");
    let (tail, _) = seq.close(Finish::Length, &tok);
    assert_eq!(tail.map(|p| p.text), Some("ab".to_string()));
}

#[test]
fn a_full_context_ends_the_sequence_and_a_cancel_releases_nothing() {
    let (_tmp, tok) = tokenizer();
    // 14 prompt tokens in a 16-position context: the first two sampled tokens run at
    // positions 14 and 15; the third has no position left.
    let mut seq = Sequence::new(vec![7; 14], params(100, &[]), 0, LIMITS).expect("valid");
    drive(&mut seq, &tok, 16, &[b'a' as u32, b'b' as u32, b'c' as u32]);
    assert_eq!(seq.finished(), Some(Finish::Context));
    assert_eq!(seq.generated().len(), 3);

    let mut seq = Sequence::new(vec![1], params(100, &["abz"]), 0, LIMITS).expect("valid");
    let step = seq.next_step(8).expect("a prefill step");
    assert_eq!(
        seq.advance(step.tokens.len(), &peak(b'a' as u32), &tok, 0),
        None
    );
    let (tail, done) = seq.close(Finish::Cancelled, &tok);
    assert_eq!(
        tail, None,
        "a cancelled sequence releases no held-back text"
    );
    assert_eq!(done.finish, Finish::Cancelled);
}

#[test]
fn bad_requests_are_refused_before_they_take_a_slot() {
    let p = params(4, &[]);
    let e = validate(&[], &p, LIMITS).unwrap_err();
    assert!(e.contains("empty"), "{e}");
    let e = validate(&[1; 16], &p, LIMITS).unwrap_err();
    assert!(e.contains("16 tokens") && e.contains("holds 16"), "{e}");
    let e = validate(&[1, VOCAB], &p, LIMITS).unwrap_err();
    assert!(e.contains(&format!("token id {VOCAB}")), "{e}");
    let mut bad = p.clone();
    bad.sampling.temperature = -1.0;
    assert!(validate(&[1], &bad, LIMITS).is_err());
    assert!(Sequence::new(vec![], p, 0, LIMITS).is_err());
}
