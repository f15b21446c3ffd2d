//! Requests to a scheduler in the library's own tests (no daemon in between): how they
//! decode, submitted, and what each gives back.

use sluice::engine::draft::DraftConfig;
use sluice::engine::scheduler::{Event, Finish, Request, Scheduler};
use sluice::engine::sequence::GenerateParams;
use sluice::text::SamplingParams;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// How the requests of a run sample and draft.
#[derive(Clone, Copy)]
pub struct Decoding {
    pub sampling: SamplingParams,
    pub draft: Option<DraftConfig>,
}

pub fn greedy() -> Decoding {
    Decoding {
        sampling: SamplingParams::default(),
        draft: None,
    }
}

/// `max_tokens` tokens decoded `how`, whatever the model ends with.
pub fn params(max_tokens: usize, how: Decoding) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: how.sampling,
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        logit_bias: Vec::new(),
        format: Default::default(),
        draft: how.draft,
        markers: false,
    }
}

pub fn submit(
    s: &Scheduler,
    prompt: &[u32],
    max_tokens: usize,
    how: Decoding,
) -> UnboundedReceiver<Event> {
    let (events, rx) = unbounded_channel();
    s.submit(Request {
        prompt_ids: prompt.to_vec(),
        params: params(max_tokens, how),
        events,
    })
    .unwrap();
    rx
}

/// A request's generated tokens and the prompt tokens it took from the cache.
pub fn collect(mut rx: UnboundedReceiver<Event>) -> (Vec<u32>, usize) {
    loop {
        match rx.blocking_recv() {
            Some(Event::Done(d)) => {
                assert_eq!(d.finish, Finish::Length);
                return (d.generated_token_ids, d.cached_tokens);
            }
            Some(Event::Failed { message, .. }) => panic!("{message}"),
            Some(Event::Piece { .. }) => {}
            None => panic!("the engine went away"),
        }
    }
}
