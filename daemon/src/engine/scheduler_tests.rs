//! The scheduler on a real (tiny) pipeline: a request's greedy tokens are the same alone
//! through `generate` and in a batch, a full queue is refused without blocking (a call of
//! several prompts whole), and a shutdown past its grace period cancels what runs and
//! what waits.

use super::generate::generate;
use super::scheduler::{Event, Finish, Request, Scheduler, SchedulerConfig, SubmitError};
use super::sequence::GenerateParams;
use super::test_model;
use crate::io::IoConfig;
use crate::pipeline::Pipeline;
use crate::text::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn params(max_tokens: usize) -> GenerateParams {
    test_model::greedy(max_tokens, &[], true)
}

fn pipeline(
    store: &Arc<crate::store::Store>,
    batch: usize,
) -> Pipeline<crate::backend::cpu::CpuBackend> {
    pipeline_of(store, batch, 64)
}

/// `pipeline` with `context` positions per sequence.
fn pipeline_of(
    store: &Arc<crate::store::Store>,
    batch: usize,
    context: usize,
) -> Pipeline<crate::backend::cpu::CpuBackend> {
    let input = crate::plan::test_input(context, batch, 16);
    super::cpu_runner(
        store.clone(),
        &input,
        1,
        IoConfig::single_stream(),
        Default::default(),
    )
    .expect("pipeline")
}

/// Collects a request's events until Done; returns its generated ids and finish.
fn collect(mut rx: UnboundedReceiver<Event>) -> (Vec<u32>, Finish) {
    let mut ids = Vec::new();
    loop {
        match rx.blocking_recv().expect("the stream ends with Done") {
            Event::Piece { token_ids, .. } => ids.extend(token_ids),
            Event::Done(d) => {
                // A cancelled sequence releases no held-back piece; Done still lists all.
                if d.finish != Finish::Cancelled {
                    assert_eq!(
                        ids, d.generated_token_ids,
                        "pieces carry every generated id"
                    );
                }
                return (d.generated_token_ids, d.finish);
            }
            Event::Failed { message, .. } => panic!("request failed: {message}"),
        }
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> (Request, UnboundedReceiver<Event>) {
    let (tx, rx) = unbounded_channel();
    let req = Request {
        prompt_ids: prompt,
        params: params(max_tokens),
        events: tx,
    };
    (req, rx)
}

fn submit(
    s: &Scheduler,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> Result<UnboundedReceiver<Event>, SubmitError> {
    let (req, rx) = request(prompt, max_tokens);
    s.submit(req)?;
    Ok(rx)
}

/// A scheduler on the tiny model with one KV slot and `queue_max` queue places, its slot
/// held by a request that runs long (its events returned once it is admitted), and the
/// directory of the model's store. Long: 4,000 tokens (tens of milliseconds), so the
/// poll below sees it admitted and the test's next steps find it still running (60 tokens,
/// as before, finished within the poll's millisecond once 16-bit and f32 decode got fast).
fn one_slot_held(
    queue_max: usize,
) -> (
    tempfile::TempDir,
    Scheduler,
    std::thread::JoinHandle<()>,
    UnboundedReceiver<Event>,
) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Arc::new(Tokenizer::from_manifest(store.manifest()).expect("tokenizer"));
    let pipeline = pipeline_of(&store, 1, 4096);
    let (s, engine) = Scheduler::start(
        pipeline,
        None,
        tok,
        SchedulerConfig {
            queue_max,
            prefix_cache: true,
            kv_tiers: Default::default(),
        },
    );
    let running = submit(&s, vec![1, 2, 3], 4000).expect("submit");
    let t0 = Instant::now();
    while s.status().active_sequences != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the request was never admitted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    (tmp, s, engine, running)
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![10, 20, 30], (1..40).collect(), vec![7; 17]]
}

#[test]
fn a_batch_gives_each_request_the_tokens_it_gets_alone() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Arc::new(Tokenizer::from_manifest(store.manifest()).expect("tokenizer"));
    let alone: Vec<Vec<u32>> = prompts()
        .iter()
        .map(|p| {
            let mut r = pipeline(&store, 1);
            generate(&mut r, &tok, p, &params(12), |_| {})
                .expect("generate")
                .generated_token_ids
        })
        .collect();
    let (s, engine) = Scheduler::start(
        pipeline(&store, 3),
        None,
        tok,
        SchedulerConfig {
            queue_max: 8,
            prefix_cache: true,
            kv_tiers: Default::default(),
        },
    );
    let rxs: Vec<_> = prompts()
        .into_iter()
        .map(|p| submit(&s, p, 12).expect("submit"))
        .collect();
    for (rx, want) in rxs.into_iter().zip(&alone) {
        let (got, finish) = collect(rx);
        assert_eq!(finish, Finish::Length);
        assert_eq!(
            &got, want,
            "batched greedy tokens differ from the request alone"
        );
    }
    s.shutdown(Duration::from_secs(5));
    engine.join().expect("engine thread");
}

#[test]
fn a_full_queue_is_refused_and_a_shutdown_past_grace_cancels_everything() {
    // One long request takes the only slot...
    let (_tmp, s, engine, running) = one_slot_held(1);
    // ...one waits in the queue, and the next is refused at once.
    let queued = submit(&s, vec![4, 5], 4).expect("one request fits the queue");
    match submit(&s, vec![6], 4) {
        Err(SubmitError::QueueFull(1)) => {}
        other => panic!("expected QueueFull(1), got {:?}", other.map(|_| ())),
    }
    match submit(&s, vec![], 4) {
        Err(SubmitError::Invalid(m)) => assert!(m.contains("empty"), "{m}"),
        other => panic!("expected Invalid, got {:?}", other.map(|_| ())),
    }
    s.shutdown(Duration::ZERO);
    let (ids, finish) = collect(running);
    assert_eq!(finish, Finish::Cancelled);
    assert!(ids.len() < 4000, "cancelled before its last token");
    let (ids, finish) = collect(queued);
    assert_eq!((ids.len(), finish), (0, Finish::Cancelled));
    assert!(matches!(
        submit(&s, vec![1], 1),
        Err(SubmitError::ShuttingDown)
    ));
    engine.join().expect("engine thread");
}

#[test]
fn a_call_of_several_prompts_is_queued_whole_or_not_at_all() {
    let (_tmp, s, engine, running) = one_slot_held(3);
    let waiting = submit(&s, vec![4, 5], 4).expect("one request waits");
    assert_eq!(s.status().queue_depth, 1);
    // Two more places are free: a call of three is refused whole and queues nothing.
    match s.reserve(3) {
        Err(SubmitError::QueueFull(3)) => {}
        other => panic!("expected QueueFull(3), got {:?}", other.map(|_| ())),
    }
    assert_eq!(
        s.status().queue_depth,
        1,
        "a refused call left requests queued"
    );
    // A call of more prompts than the queue ever holds is invalid, not "retry later".
    match s.reserve(4) {
        Err(SubmitError::Invalid(m)) => assert!(m.contains("--queue-max"), "{m}"),
        other => panic!("expected Invalid, got {:?}", other.map(|_| ())),
    }
    // Places held count as queued at once, so another client is refused meanwhile; a place
    // not used is given back when the call's places drop.
    let (first, first_rx) = request(vec![6], 4);
    {
        let mut places = s.reserve(2).expect("two places are free");
        assert_eq!(s.status().queue_depth, 3);
        match submit(&s, vec![7], 4) {
            Err(SubmitError::QueueFull(3)) => {}
            other => panic!("expected QueueFull(3), got {:?}", other.map(|_| ())),
        }
        places.submit(first).expect("queued in a held place");
        let (bad, _) = request(vec![], 4);
        match places.submit(bad) {
            Err(SubmitError::Invalid(m)) => assert!(m.contains("empty"), "{m}"),
            other => panic!("expected Invalid, got {:?}", other.map(|_| ())),
        }
    }
    assert_eq!(
        s.status().queue_depth,
        2,
        "the unused place was not given back"
    );
    s.shutdown(Duration::ZERO);
    for rx in [running, waiting, first_rx] {
        assert_eq!(collect(rx).1, Finish::Cancelled);
    }
    engine.join().expect("engine thread");
}

/// The prompt tokens a request took from the prefix cache, once it is done.
fn cached_of(mut rx: UnboundedReceiver<Event>) -> usize {
    loop {
        match rx.blocking_recv().expect("the stream ends with Done") {
            Event::Piece { .. } => {}
            Event::Done(d) => return d.cached_tokens,
            Event::Failed { message, .. } => panic!("request failed: {message}"),
        }
    }
}

#[test]
fn kept_slots_serve_their_prompts_again_and_the_least_recently_kept_goes_first() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Arc::new(Tokenizer::from_manifest(store.manifest()).expect("tokenizer"));
    let cfg = SchedulerConfig {
        queue_max: 8,
        prefix_cache: true,
        kv_tiers: Default::default(),
    };
    let (s, engine) = Scheduler::start(pipeline(&store, 2), None, tok, cfg);
    let (a, b, c): (Vec<u32>, Vec<u32>, Vec<u32>) =
        ((1..21).collect(), (30..50).collect(), (60..80).collect());
    let run = |p: &Vec<u32>| cached_of(submit(&s, p.clone(), 3).expect("submit"));
    // Two slots: A and B are kept, one each; each comes back to its own (19 of 20 tokens:
    // the last always runs).
    assert_eq!((run(&a), run(&b)), (0, 0));
    assert_eq!((run(&a), run(&b)), (19, 19));
    // C shares nothing: it takes the slot kept longest (A's, kept before B's last run).
    assert_eq!(run(&c), 0);
    assert_eq!(s.status().prefix_cache.evictions, 1);
    // B is still kept; A is not.
    assert_eq!(run(&b), 19);
    assert_eq!(run(&a), 0);
    // A prompt that goes on from a kept text takes the text, not more.
    let mut longer = a.clone();
    longer.extend([90, 91, 92]);
    assert_eq!(run(&longer), 20);
    let st = s.status().prefix_cache;
    assert_eq!((st.prompts, st.hits, st.cached_tokens), (8, 4, 19 * 3 + 20));
    // Two slots keep B's and the longer prompt's KV, each with the 2 of its 3 generated
    // tokens that ran: 22 and 25 positions (Status is published after the step that ended
    // the request, so it may lag its Done a moment).
    let t0 = Instant::now();
    let mut st = s.status().prefix_cache;
    while st.kept_tokens != 47 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
        st = s.status().prefix_cache;
    }
    assert_eq!((st.kept_slots, st.kept_tokens), (2, 47));
    assert!(st.kept_bytes > 0, "{st:?}");
    // Emptied: nothing is kept, nothing reused.
    let ticket = s.ask_clear();
    while s.clear_done(ticket).is_none() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = s.status().prefix_cache;
    assert_eq!((st.kept_slots, st.kept_bytes), (0, 0));
    assert_eq!(run(&b), 0);
    s.shutdown(Duration::from_secs(10));
    engine.join().expect("engine thread");
}

/// A request's generated tokens, whatever its finish.
fn tokens_of(rx: UnboundedReceiver<Event>) -> Vec<u32> {
    collect(rx).0
}

#[test]
fn a_kept_slot_overwritten_by_its_new_sequence_is_no_longer_a_source() {
    // Three slots: R decodes for long in one; T's and then U's texts are kept in the other
    // two. X (sharing R's prompt, not T's or U's) and Y (sharing T's) arrive together: X
    // takes the slot kept longest (T's) and copies R's prefix over T's KV there; Y, placed
    // after it, must not then take T's text from that slot.
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = test_model::store(tmp.path());
    let tok = Arc::new(Tokenizer::from_manifest(store.manifest()).expect("tokenizer"));
    let r: Vec<u32> = (100..140).collect();
    let t: Vec<u32> = (1..41).collect();
    let u: Vec<u32> = (200..240).collect();
    let mut x = r[..36].to_vec();
    x.extend([7, 7, 7]);
    let mut y = t[..36].to_vec();
    y.extend([9, 9, 9]);
    let run = |prefix_cache: bool| -> Vec<u32> {
        let cfg = SchedulerConfig {
            queue_max: 8,
            prefix_cache,
            kv_tiers: Default::default(),
        };
        let (s, engine) = Scheduler::start(pipeline_of(&store, 3, 4096), None, tok.clone(), cfg);
        let long = submit(&s, r.clone(), 3000).expect("submit");
        assert_eq!(
            tokens_of(submit(&s, t.clone(), 2).expect("submit")).len(),
            2
        );
        assert_eq!(
            tokens_of(submit(&s, u.clone(), 2).expect("submit")).len(),
            2
        );
        let mut places = s.reserve(2).expect("places");
        let (rx, ry) = (request(x.clone(), 4), request(y.clone(), 4));
        places.submit(rx.0).expect("submit");
        places.submit(ry.0).expect("submit");
        let (_, got) = (tokens_of(rx.1), tokens_of(ry.1));
        drop(long);
        s.shutdown(Duration::ZERO);
        engine.join().expect("engine thread");
        got
    };
    assert_eq!(
        run(true),
        run(false),
        "Y's tokens with the cache and without"
    );
}
