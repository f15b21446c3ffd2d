//! `sluiced verify`: reads every frame of a store and checks every checksum, reporting each
//! bad frame (not only the first) with file, layer, frame and offset.

use super::codec::FrameFault;
use super::reader::Store;
use super::StoreError;
use std::os::unix::fs::FileExt;

#[derive(Debug, Default)]
pub struct VerifyReport {
    pub units: usize,
    pub frames: usize,
    pub stored_bytes: u64,
    pub raw_bytes: u64,
    pub faults: Vec<StoreError>,
}

/// Checks every frame; `on_unit` is called after each unit with its stored bytes (progress).
pub fn verify(store: &Store, mut on_unit: impl FnMut(u64)) -> Result<VerifyReport, StoreError> {
    let file = store.open_weights()?;
    let m = store.manifest();
    let frame_max = m.frame_raw_len_max() as usize;
    let mut dec = store
        .frame_decoder(frame_max)
        .map_err(|e| StoreError::io("create decoder for", store.weights_path(), e))?;
    let mut stored = Vec::with_capacity(frame_max);
    let mut raw = vec![0u8; frame_max];
    let mut report = VerifyReport::default();
    for (ui, u) in m.units.iter().enumerate() {
        for (fi, f) in u.frames.iter().enumerate() {
            let len = f.stored_len() as usize;
            stored.resize(len, 0);
            let out = &mut raw[..f.raw_len as usize];
            let result = match file.read_exact_at(&mut stored, f.file_offset) {
                Err(e) => Err(FrameFault::Read(format!(
                    "{e} (weights.bin is {} bytes)",
                    store.weights_len()
                ))),
                Ok(()) => dec.decode(f.codec, &f.planes, f.checksum, &stored, out),
            };
            if let Err(fault) = result {
                report.faults.push(store.frame_error(ui, fi, fault));
            }
            report.frames += 1;
            report.stored_bytes += len as u64;
            report.raw_bytes += f.raw_len as u64;
        }
        report.units += 1;
        on_unit(u.stored_len);
    }
    Ok(report)
}
