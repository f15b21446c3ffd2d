//! The servers' fuzz targets (cargo-fuzz in `fuzz/`, built with the `fuzz` feature; the
//! committed corpora also run as a plain test, `fuzzing::tests`): both OpenAI bodies, and
//! a protobuf GenerateRequest, through the validation that needs no model. Any input may
//! be refused; none may panic, hang or allocate without bound.

/// Both OpenAI bodies.
pub fn openai(data: &[u8]) {
    let _ = crate::server::openai::parse_chat(data);
    let _ = crate::server::openai::parse_completion(data, 16);
}

/// A protobuf GenerateRequest as a client sends it, through the validation that does not
/// need a model.
pub fn grpc(data: &[u8]) {
    use prost::Message;
    if let Ok(r) = sluice_proto::v1::GenerateRequest::decode(data) {
        let _ = crate::server::models::parse_keep_alive(&r.keep_alive);
        if let Ok(input) = crate::server::service::input_of(r, &crate::text::sampler::FAMILIAR) {
            let _ = input.sampling.validate();
        }
    }
}
