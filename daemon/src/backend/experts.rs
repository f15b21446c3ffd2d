//! Gated MLPs, and a mixture's experts run as one call (`Backend::experts`): each expert
//! on the rows the step routed to it, added back into the block's output with their
//! routing weights. The default runs one expert after another through the backend's ops
//! (`experts_each`); a device with grouped kernels runs the decode rows of every expert
//! of the call in a few launches (`kernels/moe.cu`), with the same bits.

use super::{Backend, MatmulOut, WeightRef};

/// How a router's logits become a row's experts and weights (the model's gating, as
/// `Routes::route` applies it): softmax over every expert then the k most probable,
/// renormalized to sum 1 when `norm`; or the k largest logits then a softmax over them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteGating {
    SoftmaxTopK { norm: bool },
    TopKSoftmax,
}

/// The activation between a gated MLP's gate/up and its down projection.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GatedAct {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU (`Backend::swiglu_clamp_mul`).
    SwigluClamp { alpha: f32, limit: f32 },
}

impl GatedAct {
    /// gate = act(gate, up), `n` elements.
    pub fn apply<B: Backend + ?Sized>(self, b: &B, gate: &mut B::Mem, up: &B::Mem, n: usize) {
        match self {
            GatedAct::Silu => b.silu_mul(gate, up, n),
            GatedAct::GeluTanh => b.gelu_mul(gate, up, n),
            GatedAct::SwigluClamp { alpha, limit } => b.swiglu_clamp_mul(gate, up, n, alpha, limit),
        }
    }
}

/// A gated MLP (a dense layer's, or one expert's) on the `rows` rows of `x`, the first
/// `gemv_rows` of them decode rows: out = down(act(gate(x)) * up(x)), through `g` and `u`
/// (each projection with its bias where it has one).
#[allow(clippy::too_many_arguments)] // the MLP's inputs, weights, scratch and output
pub fn gated_mlp<B: Backend + ?Sized>(
    b: &B,
    act: GatedAct,
    (x, rows, gemv_rows): (&B::Mem, usize, usize),
    [gate, up, down]: [WeightRef<'_, B::Mem>; 3],
    bias: Option<[WeightRef<'_, B::Mem>; 3]>,
    (g, u): (&mut B::Mem, &mut B::Mem),
    out: &mut B::Mem,
) {
    let n = rows * gate.rows;
    b.matmuls(
        x,
        rows,
        gemv_rows,
        &mut [
            MatmulOut {
                w: gate,
                bias: bias.map(|b| b[0]),
                out: g,
            },
            MatmulOut {
                w: up,
                bias: bias.map(|b| b[1]),
                out: u,
            },
        ],
    );
    act.apply(b, g, u, n);
    b.matmul(g, rows, gemv_rows, down, bias.map(|b| b[2]), out);
}

/// One expert of a `Backend::experts` call: its gate, up and down projections (and their
/// biases), and the step's rows routed to it, ascending, with their routing weights.
pub struct ExpertCall<'a, M> {
    pub w: [WeightRef<'a, M>; 3],
    pub bias: Option<[WeightRef<'a, M>; 3]>,
    pub rows: &'a [u32],
    pub weights: &'a [f32],
}

/// What a `Backend::experts` call works in: room for the rows of one expert gathered
/// (`x`, hidden wide) and its output (`y`), and the gate and up activations (`gate`,
/// `up`); each holds the step's rows at least.
pub struct ExpertScratch<'a, M> {
    pub x: &'a mut M,
    pub gate: &'a mut M,
    pub up: &'a mut M,
    pub y: &'a mut M,
}

/// The shape of a `Backend::experts` call.
#[derive(Clone, Copy, Debug)]
pub struct ExpertShape {
    /// Hidden size: the columns of `x`, `out` and an expert's output.
    pub hidden: usize,
    /// The activation between gate/up and down.
    pub act: GatedAct,
    /// Whether every row of the call is a decode row (the GEMV kernels), or none is (the
    /// prefill path).
    pub decode: bool,
}

/// `Backend::experts` one expert after another, in the call's order: its rows gathered,
/// its MLP, its output added into theirs with their weights (a product, then a sum).
pub fn experts_each<B: Backend + ?Sized>(
    b: &B,
    x: &B::Mem,
    shape: ExpertShape,
    calls: &[ExpertCall<'_, B::Mem>],
    s: ExpertScratch<'_, B::Mem>,
    out: &mut B::Mem,
) {
    let ExpertScratch { x: xe, gate, up, y } = s;
    for c in calls.iter().filter(|c| !c.rows.is_empty()) {
        let m = c.rows.len();
        b.gather_rows(x, c.rows, shape.hidden, xe);
        let gemv = if shape.decode { m } else { 0 };
        gated_mlp(
            b,
            shape.act,
            (xe, m, gemv),
            c.w,
            c.bias,
            (&mut *gate, &mut *up),
            y,
        );
        b.scatter_add_rows(y, c.rows, c.weights, shape.hidden, out);
    }
}
