//! Is a CUDA device there, and what is it: the driver library, the device count, and the
//! properties the backend sizes itself by.

use super::DeviceInfo;
use cudarc::driver::{result, sys, CudaContext};
use std::sync::Arc;

/// The driver library is loadable (cudarc panics on first use when it is not).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// Whether a CUDA device can be used, and what it is; the error says why not.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, String> {
    if !driver_present() {
        return Err(
            "no NVIDIA driver library (libcuda.so.1) could be loaded: no driver installed, or not visible in this container".into(),
        );
    }
    result::init().map_err(|e| format!("CUDA driver initialisation failed: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("counting CUDA devices: {e}"))?;
    if count <= 0 {
        return Err("the NVIDIA driver reports no CUDA device".into());
    }
    if ordinal >= count as usize {
        return Err(format!(
            "CUDA device {ordinal} does not exist ({count} present)"
        ));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| format!("CUDA context on device {ordinal}: {e}"))?;
    info_of(&ctx)
}

pub(super) fn info_of(ctx: &Arc<CudaContext>) -> Result<DeviceInfo, String> {
    let e = |what: &str, e: result::DriverError| format!("{what}: {e}");
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|x| e("compute capability", x))?;
    let (free, total) = ctx.mem_get_info().map_err(|x| e("memory info", x))?;
    let mut driver = 0;
    // SAFETY: the driver is initialised (a context exists); writes one int.
    unsafe { sys::cuDriverGetVersion(&mut driver) };
    let smem = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|x| e("shared memory limit", x))?;
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().unwrap_or_else(|_| "unknown".into()),
        compute_capability: (major, minor),
        total_bytes: total as u64,
        free_bytes: free as u64,
        driver_version: driver,
        max_shared_per_block: smem.max(0) as usize,
    })
}
