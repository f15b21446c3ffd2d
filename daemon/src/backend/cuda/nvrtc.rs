//! Kernel compilation with NVRTC through cudarc (loaded at run time). cudarc panics when the
//! library is missing, so its presence is checked first with dlopen and reported as an
//! error that says what to install.

use cudarc::nvrtc::result;
use std::ffi::{CStr, CString};

/// The library names cudarc searches for NVRTC.
fn candidates() -> Vec<String> {
    cudarc::get_lib_name_candidates("nvrtc")
}

/// Ok when an NVRTC library can be loaded; otherwise the names searched.
pub fn library_present() -> Result<(), String> {
    for name in candidates() {
        let c = CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: dlopen with a valid C string; the handle is closed at once (cudarc opens
        // its own).
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !h.is_null() {
            // SAFETY: h came from dlopen above.
            unsafe { libc::dlclose(h) };
            return Ok(());
        }
    }
    Err(format!(
        "NVRTC not found (searched {:?}); install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH",
        candidates()
    ))
}

/// Kernel files whose results decide which path the model takes or scale every value
/// after them — the router's top-k and its renormalization (`moe`), the norms
/// (`rms_norm`), the rotary embedding (`rope`) — compile without `--use_fast_math`: no
/// flush of denormals to zero (an MXFP4 scale of exponent 0 or 1 is a denormal), IEEE
/// division and `sqrtf`, full-precision `expf`, `sinf`, `cosf` and `powf`, as the CPU
/// backend and the emulator compute them (the norm writes `1.0f / sqrtf`, not the
/// hardware's `rsqrtf`; a block's sum still adds in another order than the CPU's). The
/// rest (the GEMVs and GEMMs, attention, conversions) keep fast math; their tests compare
/// within tolerances.
pub const EXACT_MATH: [&str; 3] = ["moe", "rms_norm", "rope"];

/// The NVRTC options kernel file `name` is compiled with for `arch` (a compiled kernel's
/// cache key includes them).
pub fn options(arch: &str, name: &str) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    if !EXACT_MATH.contains(&name) {
        o.push("--use_fast_math".to_string());
    }
    o
}

pub struct Compiled {
    pub ptx: String,
    /// Warnings and notes NVRTC printed (empty for a clean compile).
    pub log: String,
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32), String> {
    library_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; nvrtcVersion writes two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion: {r:?}"));
    }
    Ok((major, minor))
}

/// Compiles `src` to a CUBIN for a real architecture (e.g. "sm_90"): machine code the
/// driver loads without a PTX JIT, so a newer NVRTC works with an older driver.
pub fn compile_cubin(name: &str, src: &str, sm: &str) -> Result<(Vec<u8>, String), String> {
    compile_with(name, src, sm, |prog| {
        let mut size = 0usize;
        // SAFETY: prog compiled successfully; NVRTC writes the size, then that many bytes.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog, &mut size) };
        if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(format!("{name} for {sm}: no CUBIN ({r:?})"));
        }
        let mut bin = vec![0u8; size];
        // SAFETY: bin has the size NVRTC reported.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _) };
        if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("{name} for {sm}: get CUBIN: {r:?}"));
        }
        Ok(bin)
    })
}

/// Compiles `src` for `arch` (e.g. "compute_80"). Fails with the log on any error.
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Compiled, String> {
    compile_with(name, src, arch, |prog| {
        // SAFETY: prog compiled successfully.
        match unsafe { result::get_ptx(prog) } {
            // SAFETY: NVRTC returns NUL-terminated PTX.
            Ok(raw) => Ok(unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned()),
            Err(e) => Err(format!("{name} for {arch}: get PTX: {e:?}")),
        }
    })
    .map(|(ptx, log)| Compiled { ptx, log })
}

fn compile_with<T>(
    name: &str,
    src: &str,
    arch: &str,
    output: impl FnOnce(cudarc::nvrtc::sys::nvrtcProgram) -> Result<T, String>,
) -> Result<(T, String), String> {
    library_present()?;
    let src_c = CString::new(src).map_err(|_| format!("{name}: source contains a NUL byte"))?;
    let name_c = CString::new(format!("{name}.cu")).map_err(|_| format!("{name}: bad name"))?;
    let prog = result::create_program(&src_c, Some(name_c.as_c_str()))
        .map_err(|e| format!("{name}: create program: {e:?}"))?;
    let opts = options(arch, name);
    // SAFETY: prog is a live program from create_program; it is destroyed below on every path.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(prog) }
        .map(|raw| {
            // SAFETY: NVRTC returns a NUL-terminated log.
            unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(format!("{name} for {arch}: {e:?}\n{log}")),
        Ok(()) => output(prog).map(|o| (o, log)),
    };
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}
