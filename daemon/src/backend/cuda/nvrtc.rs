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

pub struct Compiled {
    pub ptx: String,
    /// Warnings and notes NVRTC printed (empty for a clean compile).
    pub log: String,
}

/// Compiles `src` for `arch` (e.g. "compute_80"). Fails with the log on any error.
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Compiled, String> {
    library_present()?;
    let src_c = CString::new(src).map_err(|_| format!("{name}: source contains a NUL byte"))?;
    let name_c = CString::new(format!("{name}.cu")).map_err(|_| format!("{name}: bad name"))?;
    let prog = result::create_program(&src_c, Some(name_c.as_c_str()))
        .map_err(|e| format!("{name}: create program: {e:?}"))?;
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--use_fast_math".to_string(),
    ];
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
        Ok(()) => {
            // SAFETY: as above; compile succeeded.
            match unsafe { result::get_ptx(prog) } {
                // SAFETY: NVRTC returns NUL-terminated PTX.
                Ok(raw) => Ok(Compiled {
                    ptx: unsafe { CStr::from_ptr(raw.as_ptr()) }
                        .to_string_lossy()
                        .into_owned(),
                    log,
                }),
                Err(e) => Err(format!("{name} for {arch}: get PTX: {e:?}")),
            }
        }
    };
    // SAFETY: prog is live and not used after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}
