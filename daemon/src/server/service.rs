//! The `sluice.v1.Inference` service. Conversion between engine errors and gRPC status
//! codes happens here and nowhere else.

use super::api::{ApiError, ErrorKind, Frontend, GenerateInput, Prompt};
use super::metrics::Api;
use crate::engine::scheduler::{Event, Finish};
use crate::plan::{Placement, Plan};
use crate::text::{ChatMessage, SamplingParams};
use sluice_proto::v1 as pb;
use sluice_proto::v1::inference_server::Inference;
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request as GrpcRequest, Response, Status};

pub struct Service {
    pub front: Arc<Frontend>,
    pub plan: Plan,
    pub backend: String,
    pub device_budget: u64,
    /// The numerics the pipeline runs: "exact" or "fast", and the KV cache type.
    pub numerics: &'static str,
    pub kv_dtype: crate::backend::KvDtype,
    /// KV slots: sequences one pass serves at most.
    pub max_batch: usize,
}

/// The one place request errors become gRPC status codes.
pub fn status_of(e: ApiError) -> Status {
    let m = e.message;
    match e.kind {
        ErrorKind::Invalid => Status::invalid_argument(m),
        ErrorKind::ModelNotFound => Status::not_found(m),
        ErrorKind::Unauthenticated => Status::unauthenticated(m),
        ErrorKind::QueueFull => Status::resource_exhausted(m),
        ErrorKind::Unavailable => Status::unavailable(m),
        ErrorKind::DataLoss => Status::data_loss(m),
        ErrorKind::Internal => Status::internal(m),
    }
}

fn finish_reason(f: Finish) -> pb::FinishReason {
    match f {
        Finish::Stop => pb::FinishReason::Stop,
        Finish::Length => pb::FinishReason::Length,
        Finish::StopString => pb::FinishReason::StopString,
        Finish::Context => pb::FinishReason::Context,
        Finish::Cancelled => pb::FinishReason::Cancelled,
    }
}

/// The request in the shape both wires share: token ids first, then messages, then text.
fn input_of(r: pb::GenerateRequest) -> GenerateInput {
    let prompt = if !r.prompt_token_ids.is_empty() {
        Prompt::Ids(r.prompt_token_ids)
    } else if !r.messages.is_empty() {
        Prompt::Messages(
            r.messages
                .into_iter()
                .map(|m| ChatMessage {
                    role: m.role,
                    content: m.content,
                })
                .collect(),
        )
    } else {
        Prompt::Text(r.prompt)
    };
    let s = r.sampling.unwrap_or_default();
    GenerateInput {
        model: r.model,
        prompt,
        max_tokens: (r.max_tokens != 0).then_some(r.max_tokens),
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
            min_p: s.min_p,
            seed: s.seed,
            repetition_penalty: if s.repetition_penalty == 0.0 {
                1.0
            } else {
                s.repetition_penalty
            },
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
        },
        stop: r.stop,
        logprobs: None,
        truncate: r.truncate,
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for Service {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: GrpcRequest<pb::GenerateRequest>,
    ) -> Result<Response<GenStream>, Status> {
        let sub = self
            .front
            .submit(Api::Grpc, input_of(req.into_inner()))
            .map_err(status_of)?;
        // The stream ends after Done (the engine drops its sender); a client that goes away
        // drops the receiver, which the engine sees and evicts the sequence.
        let truncated = sub.truncated;
        let stream = sub.events.map(move |ev| match ev {
            Event::Piece {
                text, token_ids, ..
            } => Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Piece(pb::TokenPiece {
                    text,
                    token_ids,
                })),
            }),
            Event::Done(d) => Ok(pb::GenerateResponse {
                event: Some(pb::generate_response::Event::Done(pb::GenerateDone {
                    finish_reason: finish_reason(d.finish) as i32,
                    stats: Some(pb::GenerateStats {
                        prompt_tokens: d.prompt_token_ids.len() as u32,
                        generated_tokens: d.generated_token_ids.len() as u32,
                        time_to_first_token_s: d.time_to_first_token_s,
                        prefill_tokens_per_s: d.prefill_tokens_per_s,
                        decode_tokens_per_s: d.decode_tokens_per_s,
                        bytes_streamed: d.bytes_streamed,
                    }),
                    prompt_token_ids: d.prompt_token_ids,
                    generated_token_ids: d.generated_token_ids,
                    prompt_truncated: truncated,
                })),
            }),
            Event::Failed {
                data_loss: true,
                message,
            } => Err(Status::data_loss(message)),
            Event::Failed {
                data_loss: false,
                message,
            } => Err(Status::internal(message)),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn tokenize(
        &self,
        req: GrpcRequest<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = req.into_inner();
        self.front.check_model(&r.model).map_err(status_of)?;
        let tok = &self.front.sched.tokenizer;
        let ids = tok
            .encode(&r.text, r.add_special_tokens)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let pieces = ids.iter().map(|&i| tok.piece(i)).collect();
        let texts = ids
            .iter()
            .map(|&i| String::from_utf8_lossy(&tok.token_bytes(i)).into_owned())
            .collect();
        Ok(Response::new(pb::TokenizeResponse {
            token_ids: ids,
            pieces,
            texts,
        }))
    }

    async fn list_models(
        &self,
        _req: GrpcRequest<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let m = &self.front.meta;
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: m.name.clone(),
                architecture: m.architecture.clone(),
                layers: m.layers,
                hidden_size: m.hidden,
                vocab_size: m.vocab,
                context_length: m.context,
                stored_bytes: m.stored_bytes,
                raw_bytes: m.raw_bytes,
            }],
        }))
    }

    async fn status(
        &self,
        _req: GrpcRequest<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let s = self.front.sched.status();
        let p = &self.plan;
        let st = &s.stages;
        let stage = |name: &str, rate: f64, secs: f64| pb::StageThroughput {
            stage: name.into(),
            bytes_per_s: rate,
            stall_s: secs,
        };
        Ok(Response::new(pb::StatusResponse {
            model: self.front.meta.name.clone(),
            backend: self.backend.clone(),
            device_bytes_budget: self.device_budget,
            device_bytes_peak: s.device_bytes_peak,
            kv_cache_bytes: p.kv_cache_bytes,
            host_cache_bytes: p.host_cache_bytes,
            layers: p
                .units
                .iter()
                .map(|u| pb::LayerPlacement {
                    layer: u.unit.clone(),
                    placement: match u.placement {
                        Placement::Resident => "resident",
                        Placement::Streamed => "streamed",
                        Placement::HostCached => "host-cached",
                    }
                    .into(),
                    raw_bytes: u.raw_bytes,
                })
                .collect(),
            layers_resident: p.layers_resident() as u32,
            layers_streamed: p.layers_streamed() as u32,
            bytes_streamed_per_pass: p.upload_bytes_per_pass,
            last_pass_time_s: s.last_pass_time_s,
            decode_tokens_per_s: s.decode_tokens_per_s,
            queue_depth: s.queue_depth as u32,
            active_sequences: s.active_sequences as u32,
            stages: vec![
                stage("disk_read", st.disk_read_bytes_per_s, st.disk_read_s),
                stage("decompress", st.decompress_bytes_per_s, st.decompress_s),
                stage("upload", st.upload_bytes_per_s, st.upload_s),
                stage("compute", st.compute_weight_bytes_per_s, st.compute_s),
            ],
            limiting_stage: st.limiting_stage.clone(),
            passes: s.passes,
            bytes_streamed_total: s.bytes_streamed_total,
            host_bytes_budget: p.host.budget.unwrap_or(0),
            host_bytes_planned: p.host.total_bytes,
            host_bytes_peak: crate::hostmem::peak_rss_bytes().unwrap_or(0),
            host_bytes_peak_source: "VmHWM".into(),
            numerics: self.numerics.into(),
            kv_dtype: self.kv_dtype.to_string(),
            max_batch: self.max_batch as u32,
            max_context: self.front.sched.max_context as u32,
        }))
    }

    async fn complete(
        &self,
        req: GrpcRequest<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let r = req.into_inner();
        let (code, body) = super::http::call_json(
            self.front.clone(),
            Api::Grpc,
            &r.url,
            r.body_json.as_bytes(),
            r.truncate,
        )
        .await;
        Ok(Response::new(pb::CompleteResponse {
            status_code: u32::from(code),
            body_json: body.to_string(),
        }))
    }
}
