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

/// Driver entry points this build calls that older drivers lack. cudarc built for the
/// CUDA 13 driver API times events with cuEventElapsedTime_v2 (drivers of the r570 branch,
/// CUDA 12.8, and later), and it panics on a symbol the driver does not export: the
/// backend checks for them first.
const REQUIRED_SYMBOLS: &[&str] = &["cuEventElapsedTime_v2"];

/// The required entry points this driver library does not export.
fn missing_symbols() -> Vec<&'static str> {
    // SAFETY: only called once the library loads (`driver_present`); `get` looks a name up
    // without calling it.
    let lib = unsafe { sys::culib() };
    REQUIRED_SYMBOLS
        .iter()
        .copied()
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect()
}

/// Refuses a driver that lacks an entry point this build calls, saying which and what to do.
pub fn driver_requirement(driver_version: i32, missing: &[&str]) -> Result<(), String> {
    if missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the NVIDIA driver (CUDA {}.{}) lacks {}, which sluice calls to time its uploads; it comes with drivers of the r570 branch (CUDA 12.8) and later: update the driver, or run with --backend cpu",
        driver_version / 1000,
        driver_version % 1000 / 10,
        missing.join(", ")
    ))
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
    let info = info_of(&ctx)?;
    check_driver(&info)?;
    Ok(info)
}

/// `driver_requirement` for the driver loaded in this process.
pub(super) fn check_driver(info: &DeviceInfo) -> Result<(), String> {
    driver_requirement(info.driver_version, &missing_symbols())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_without_the_v2_event_timer_is_refused_with_what_to_do() {
        assert!(driver_requirement(12080, &[]).is_ok());
        let e = driver_requirement(12040, &["cuEventElapsedTime_v2"]).unwrap_err();
        for part in [
            "CUDA 12.4",
            "cuEventElapsedTime_v2",
            "r570",
            "update the driver",
            "--backend cpu",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
    }
}
