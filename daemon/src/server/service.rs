//! The `sluice.v1.Inference` service. Conversion between engine errors and gRPC status
//! codes happens here and nowhere else.

use super::api::{ApiError, ErrorKind, Format, Frontend, GenerateInput, Prompt, RequestLimits};
use super::metrics::{Api, Metrics};
use super::models::{parse_keep_alive, Models};
use crate::engine::scheduler::{Event, Finish};
use crate::plan::Placement;
use crate::text::grammar::Grammar;
use crate::text::tool_parse::ToolParser;
use crate::text::tools::Tools;
use crate::text::{ChatMessage, SamplingParams};
use sluice_proto::v1 as pb;
use sluice_proto::v1::inference_server::Inference;
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request as GrpcRequest, Response, Status};

pub struct Service {
    pub models: Arc<Models>,
    pub metrics: Arc<Metrics>,
    pub limits: RequestLimits,
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
/// A gRPC request as the front end takes it; an unset sampling field (or no `sampling`)
/// takes `defaults`, the model's (`SamplingParams::model_default`).
pub(crate) fn input_of(
    r: pb::GenerateRequest,
    defaults: &SamplingParams,
) -> Result<GenerateInput, ApiError> {
    let format = format_of(&r)?;
    let tools = tools_of(&r)?;
    let prompt = if !r.prompt_token_ids.is_empty() {
        Prompt::Ids(r.prompt_token_ids)
    } else if !r.messages.is_empty() {
        Prompt::Messages(chat_messages(&r.messages)?, Vec::new())
    } else {
        Prompt::Text(r.prompt)
    };
    let s = r.sampling.unwrap_or_default();
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_by_key(|&(t, _)| t);
    Ok(GenerateInput {
        model: r.model,
        prompt,
        max_tokens: (r.max_tokens != 0).then_some(r.max_tokens),
        sampling: sampling_of(&s, defaults),
        stop: r.stop,
        logprobs: None,
        truncate: r.truncate,
        logit_bias,
        format,
        tools,
    })
}

/// The messages as the OpenAI API would take them, checked by its rules (a tool message
/// answers an earlier call).
fn chat_messages(list: &[pb::ChatMessage]) -> Result<Vec<ChatMessage>, ApiError> {
    super::openai::messages(list.iter().map(sluice_proto::openai_message).collect())
}

/// The request's tools, tool_choice and parallel_tool_calls, read as the OpenAI API reads
/// them.
fn tools_of(r: &pb::GenerateRequest) -> Result<Option<Tools>, ApiError> {
    if r.tools.is_empty() && r.tool_choice.is_empty() {
        return Ok(None);
    }
    let mut list = Vec::with_capacity(r.tools.len());
    for (i, t) in r.tools.iter().enumerate() {
        let parameters = if t.parameters.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&t.parameters).map_err(|e| {
                ApiError::invalid(
                    Some("tools"),
                    format!("tools[{i}].parameters is not JSON: {e}"),
                )
            })?
        };
        list.push(serde_json::json!({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": parameters}}));
    }
    let choice = match r.tool_choice.as_str() {
        "" => None,
        "auto" | "none" | "required" => Some(serde_json::Value::from(r.tool_choice.clone())),
        name => Some(serde_json::json!({"type": "function", "function": {"name": name}})),
    };
    Tools::parse(&list, choice.as_ref(), r.parallel_tool_calls)
        .map(Some)
        .map_err(|(field, m)| ApiError::invalid(Some(field), m))
}

/// The sampling a request's settings `s` ask for, `defaults` (the model's) where it leaves
/// one out: the one mapping of the wire's settings (gRPC, and `sluiced run`'s flags).
pub fn sampling_of(s: &pb::SamplingParams, defaults: &SamplingParams) -> SamplingParams {
    crate::text::sampler::SamplingChoice {
        temperature: s.temperature,
        top_k: s.top_k.map(|k| k as usize),
        // 0 is off, as 1 is (proto3 JSON clients write 0 for "no value").
        top_p: s.top_p.map(|p| if p == 0.0 { 1.0 } else { p }),
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty.map(|r| if r == 0.0 { 1.0 } else { r }),
    }
    .over(&SamplingParams {
        seed: s.seed,
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        ..*defaults
    })
}

/// The request's response format with the field that carries it, each checked for being
/// there (the grammar itself is checked when it is compiled for the model).
fn format_of(r: &pb::GenerateRequest) -> Result<Option<Format>, ApiError> {
    let need = |param: &'static str, kind: &str, empty: bool| {
        if empty {
            Err(ApiError::invalid(
                Some(param),
                format!("RESPONSE_FORMAT_{kind} needs {param}"),
            ))
        } else {
            Ok(())
        }
    };
    let (grammar, param) = match r.response_format() {
        pb::ResponseFormat::Text => return Ok(None),
        pb::ResponseFormat::JsonObject => (Grammar::JsonObject, "response_format"),
        pb::ResponseFormat::JsonSchema => {
            need("json_schema", "JSON_SCHEMA", r.json_schema.is_empty())?;
            let schema = serde_json::from_str(&r.json_schema).map_err(|e| {
                ApiError::invalid(Some("json_schema"), format!("json_schema is not JSON: {e}"))
            })?;
            (Grammar::JsonSchema(schema), "json_schema")
        }
        pb::ResponseFormat::Regex => {
            need("regex", "REGEX", r.regex.is_empty())?;
            (Grammar::Regex(r.regex.clone()), "regex")
        }
        pb::ResponseFormat::Grammar => {
            need("grammar", "GRAMMAR", r.grammar.trim().is_empty())?;
            (Grammar::Lark(r.grammar.clone()), "grammar")
        }
        pb::ResponseFormat::Choice => {
            need("choice", "CHOICE", r.choice.is_empty())?;
            (Grammar::Choice(r.choice.clone()), "choice")
        }
    };
    Ok(Some(Format { grammar, param }))
}

/// A parser's events: the content text and the reasoning (returned) and the calls,
/// collected.
fn tool_events(
    events: Vec<crate::text::answer::ToolEvent>,
    calls: &mut Vec<pb::ToolCall>,
) -> (String, String) {
    use crate::text::answer::ToolEvent;
    let (mut text, mut reasoning) = (String::new(), String::new());
    for e in events {
        match e {
            ToolEvent::Text(t) => text.push_str(&t),
            ToolEvent::Reasoning(t) => reasoning.push_str(&t),
            ToolEvent::Call { id, name, .. } => calls.push(pb::ToolCall {
                id,
                name,
                arguments: String::new(),
            }),
            ToolEvent::Args { index, text: a } => {
                if let Some(c) = calls.get_mut(index) {
                    c.arguments.push_str(&a);
                }
            }
        }
    }
    (text, reasoning)
}

type GenStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for Service {
    type GenerateStream = GenStream;

    async fn generate(
        &self,
        req: GrpcRequest<pb::GenerateRequest>,
    ) -> Result<Response<GenStream>, Status> {
        let r = req.into_inner();
        let refuse = |e: ApiError| {
            self.metrics.request(Api::Grpc, e.kind.outcome());
            status_of(e)
        };
        let keep = parse_keep_alive(&r.keep_alive)
            .map_err(|m| refuse(ApiError::invalid(Some("keep_alive"), m)))?;
        let (served, _hold) = self.models.resolve(&r.model, keep).await.map_err(refuse)?;
        let input = input_of(r, &served.front.meta.sampling).map_err(refuse)?;
        let chat = matches!(input.prompt, Prompt::Messages(..));
        let mut parser = served
            .front
            .answer_syntax(chat, input.tools.as_ref())
            .map(ToolParser::new);
        let sub = served.front.submit(Api::Grpc, input).map_err(status_of)?;
        let mut calls: Vec<pb::ToolCall> = Vec::new();
        // The stream ends after Done (the engine drops its sender); a client that goes away
        // drops the receiver, which the engine sees and evicts the sequence.
        let truncated = sub.truncated;
        let stream = sub.events.map(move |ev| match ev {
            Event::Piece {
                text, token_ids, ..
            } => {
                let (text, reasoning) = match &mut parser {
                    Some(p) => tool_events(p.feed(&text), &mut calls),
                    None => (text, String::new()),
                };
                Ok(pb::GenerateResponse {
                    event: Some(pb::generate_response::Event::Piece(pb::TokenPiece {
                        text,
                        token_ids,
                        reasoning,
                    })),
                })
            }
            Event::Done(d) => {
                let mut reason = finish_reason(d.finish);
                if let Some(p) = &mut parser {
                    // What was held back at the end is content nobody will read past the
                    // calls; a text without calls keeps it in the pieces already sent.
                    tool_events(p.finish(), &mut calls);
                    if !calls.is_empty() && reason == pb::FinishReason::Stop {
                        reason = pb::FinishReason::ToolCalls;
                    }
                }
                Ok(pb::GenerateResponse {
                    event: Some(pb::generate_response::Event::Done(pb::GenerateDone {
                        tool_calls: std::mem::take(&mut calls),
                        finish_reason: reason as i32,
                        stats: Some(pb::GenerateStats {
                            prompt_tokens: d.prompt_token_ids.len() as u32,
                            generated_tokens: d.generated_token_ids.len() as u32,
                            time_to_first_token_s: d.time_to_first_token_s,
                            prefill_tokens_per_s: d.prefill_tokens_per_s,
                            decode_tokens_per_s: d.decode_tokens_per_s,
                            bytes_streamed: d.bytes_streamed,
                            cached_tokens: d.cached_tokens as u32,
                        }),
                        prompt_token_ids: d.prompt_token_ids,
                        generated_token_ids: d.generated_token_ids,
                        prompt_truncated: truncated,
                    })),
                })
            }
            Event::Failed { failure, message } => Err(status_of(ApiError::new(
                ErrorKind::of_failure(failure),
                message,
            ))),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn tokenize(
        &self,
        req: GrpcRequest<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = req.into_inner();
        let (served, _hold) = self
            .models
            .resolve(&r.model, None)
            .await
            .map_err(status_of)?;
        let front = &served.front;
        let tok = &front.sched.tokenizer;
        let ids = if r.messages.is_empty() {
            tok.encode(&r.text, r.add_special_tokens)
                .map_err(|e| Status::invalid_argument(e.to_string()))?
        } else {
            let msgs = r
                .messages
                .into_iter()
                .map(|m| ChatMessage::new(m.role, m.content))
                .collect();
            front
                .prompt_ids(&Prompt::Messages(msgs, Vec::new()))
                .map_err(status_of)?
        };
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
        req: GrpcRequest<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let loaded_only = req.into_inner().loaded_only;
        let context = self.models.cfg.max_context as u32;
        let models = self
            .models
            .list(loaded_only)
            .into_iter()
            .map(|l| pb::ModelInfo {
                name: l.name,
                architecture: l.info.architecture,
                layers: l.info.layers,
                hidden_size: l.info.hidden,
                vocab_size: l.info.vocab,
                context_length: context,
                stored_bytes: l.info.stored_bytes,
                raw_bytes: l.info.raw_bytes,
                loaded: l.loaded,
                quantization: l.info.quantization,
                device_bytes: l.device_bytes,
                host_bytes: l.host_bytes,
                unload_in_s: match (l.loaded, l.unload_in) {
                    (false, _) => 0.0,
                    (true, Some(d)) => d.as_secs_f64(),
                    (true, None) => -1.0,
                },
                active_requests: l.active_requests as u32,
                path: l.dir.display().to_string(),
                prefix_cache_bytes: l.prefix_cache_bytes,
                kv_host_bytes: l.kv_host_bytes,
                kv_disk_bytes: l.kv_disk_bytes,
            })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }

    async fn status(
        &self,
        req: GrpcRequest<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let (name, served) = self
            .models
            .loaded(&req.into_inner().model)
            .map_err(status_of)?;
        let Some(served) = served else {
            // Not loaded: what holds for every model, and nothing of a plan.
            return Ok(Response::new(pb::StatusResponse {
                model: name,
                backend: self.models.cfg.backend.clone(),
                max_batch: self.models.cfg.max_batch as u32,
                max_context: self.models.cfg.max_context as u32,
                ..Default::default()
            }));
        };
        let s = served.front.sched.status();
        // The plan in use: the one loaded, or the last change of placement's.
        let follow = s.following.as_ref();
        let p = follow
            .and_then(|f| f.plan.as_deref())
            .unwrap_or(&served.plan);
        let st = &s.stages;
        let host_peak = crate::hostmem::host_peak();
        let stage = |name: &str, rate: f64, secs: f64| pb::StageThroughput {
            stage: name.into(),
            bytes_per_s: rate,
            stall_s: secs,
        };
        Ok(Response::new(pb::StatusResponse {
            model: name,
            backend: served.backend.clone(),
            device_bytes_budget: p.device_budget,
            device_bytes_peak: s.device_bytes_peak,
            kv_cache_bytes: p.kv_cache_bytes,
            host_cache_bytes: p.host_cache_bytes,
            layers: layers_of(p),
            placement: Some(placement_of(
                p,
                follow
                    .and_then(|f| f.choice.as_ref())
                    .or(served.placement.as_ref()),
                follow,
            )),
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
            host_bytes_peak: host_peak.0,
            host_bytes_peak_source: host_peak.1.into(),
            numerics: served.numerics.into(),
            int_dots: served.int_dots.into(),
            kv_dtype: served.kv_dtype.to_string(),
            max_batch: served.max_batch as u32,
            max_context: served.front.sched.max_context as u32,
            io_read_buffers: s.io_pools.read_buffers as u32,
            io_read_buffers_free: s.io_pools.read_buffers_free as u32,
            io_slots: s.io_pools.slots as u32,
            io_slots_free: s.io_pools.slots_free as u32,
            io_slots_pageable: s.io_pools.slots_pageable as u32,
            io_units_failed: s.io.units_failed,
            io_reads_stalled: s.io.reads_stalled,
            io_short_reads: s.io.short_reads,
            host_heap_in_use_bytes: crate::hostmem::heap_in_use_bytes().unwrap_or(0),
            expert_routing: s
                .expert_tokens
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.is_empty())
                .map(|(layer, t)| pb::ExpertRouting {
                    layer: layer as u32,
                    tokens: t.clone(),
                })
                .collect(),
            speculative: Some(speculative_of(
                &served.front,
                &s.speculative,
                s.totals.pass_time_s,
            )),
            expert_streaming: Some(expert_streaming_of(&s.totals, p)),
            prefix_cache: Some(prefix_cache_of(&s.prefix_cache)),
        }))
    }

    async fn clear_cache(
        &self,
        req: GrpcRequest<pb::ClearCacheRequest>,
    ) -> Result<Response<pb::ClearCacheResponse>, Status> {
        let model = req.into_inner().model;
        let cleared = self
            .models
            .clear_prefix_caches(&model)
            .await
            .map_err(status_of)?;
        Ok(Response::new(pb::ClearCacheResponse {
            models: cleared
                .into_iter()
                .map(|(model, positions)| pb::ClearedCache { model, positions })
                .collect(),
        }))
    }

    async fn complete(
        &self,
        req: GrpcRequest<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let r = req.into_inner();
        let (code, body) = super::http::call_json(
            &self.models,
            &self.metrics,
            &self.limits,
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

/// Status's speculative decoding: the model's drafter and the counts since it loaded.
fn speculative_of(
    front: &Frontend,
    s: &crate::engine::draft::SpecStats,
    pass_seconds: f64,
) -> pb::Speculative {
    pb::Speculative {
        drafter: front.drafter.clone(),
        drafted_tokens: s.drafted_tokens,
        accepted_tokens: s.accepted_tokens,
        tokens_per_step: s.tokens_per_step.to_vec(),
        draft_passes: s.draft_passes,
        draft_seconds: s.draft_seconds,
        pass_seconds,
    }
}

/// Status's units and where the plan put each.
pub fn layers_of(p: &crate::plan::Plan) -> Vec<pb::LayerPlacement> {
    p.units
        .iter()
        .enumerate()
        .map(|(i, u)| pb::LayerPlacement {
            layer: u.unit.clone(),
            placement: match u.placement {
                Placement::Resident => "resident".into(),
                Placement::Streamed => "streamed".into(),
                Placement::HostCached => "host-cached".into(),
                Placement::Host => "cpu".into(),
                // Unit i is decoder layer i - 1.
                Placement::OtherDevice => p
                    .devices
                    .iter()
                    .find(|d| d.layers.contains(&i.wrapping_sub(1)))
                    .map_or("device".into(), |d| format!("device:{}", d.name)),
            },
            raw_bytes: u.raw_bytes,
        })
        .collect()
}

/// Status's placement: the plan's host layers and other devices' spans, and for
/// placement "auto" (`auto`) the choice and the placements it weighed, and what following
/// the batch changed (`follow`).
pub fn placement_of(
    p: &crate::plan::Plan,
    auto: Option<&crate::plan::placement::Choice>,
    follow: Option<&crate::engine::replace::Following>,
) -> pb::Placement {
    let f = follow.cloned().unwrap_or_default();
    pb::Placement {
        changes: f.changes,
        changes_failed: f.failed,
        last_change_s: f.last_change_s,
        last_change_kv_bytes: f.last_change_kv_bytes,
        mode: if auto.is_some() { "auto" } else { "device" }.into(),
        cpu_layers: p.cpu_layers as u32,
        devices: p
            .devices
            .iter()
            .map(|d| pb::DeviceLayers {
                device: d.name.clone(),
                first_layer: d.layers.start as u32,
                layers: d.layers.len() as u32,
            })
            .collect(),
        rows: auto.map_or(0, |c| c.rows as u32),
        predicted_pass_s: auto.and_then(|c| c.chosen()).map_or(0.0, |c| c.pass_s),
        candidates: auto.map_or(Vec::new(), |c| {
            c.candidates
                .iter()
                .map(|c| pb::PlacementCandidate {
                    cpu_layers: c.cpu_layers as u32,
                    predicted_pass_s: c.pass_s,
                })
                .collect()
        }),
    }
}

/// Status's prefix cache.
fn prefix_cache_of(p: &crate::engine::prefix::PrefixStats) -> pb::PrefixCache {
    pb::PrefixCache {
        enabled: p.enabled,
        kept_slots: p.kept_slots as u32,
        kept_tokens: p.kept_tokens,
        kept_bytes: p.kept_bytes,
        prompts: p.prompts,
        hits: p.hits,
        prompt_tokens: p.prompt_tokens,
        cached_tokens: p.cached_tokens,
        evictions: p.evictions,
        host_budget_bytes: p.tiers.host_budget_bytes,
        host_bytes: p.tiers.host_bytes,
        host_blocks: p.tiers.host_blocks,
        host_hits: p.tiers.host_hits,
        host_tokens: p.tiers.host_tokens,
        disk_enabled: p.tiers.disk_enabled,
        disk_budget_bytes: p.tiers.disk.budget_bytes,
        disk_bytes: p.tiers.disk.bytes,
        disk_blocks: p.tiers.disk.blocks,
        disk_hits: p.tiers.disk_hits,
        disk_tokens: p.tiers.disk_tokens,
        disk_write_errors: p.tiers.disk.write_errors,
        disk_read_errors: p.tiers.disk.read_errors,
        exported_blocks: p.tiers.exported_blocks,
    }
}

/// Status's expert streaming: what the passes' sparse layers routed, found and loaded.
fn expert_streaming_of(
    t: &crate::pipeline::PassStats,
    p: &crate::plan::Plan,
) -> pb::ExpertStreaming {
    pb::ExpertStreaming {
        routed: t.experts_routed,
        cache_hits: t.expert_cache_hits,
        loaded: t.experts_loaded,
        bytes_loaded: t.expert_bytes_loaded,
        predicted: t.experts_predicted,
        predicted_used: t.experts_predicted_used,
        prefetched: t.expert_prefetches,
        prefetched_unused: t.expert_prefetches_wasted,
        cache_slots: p.expert_cache_slots as u32,
        hot_slots: p.expert_hot_slots as u32,
    }
}
