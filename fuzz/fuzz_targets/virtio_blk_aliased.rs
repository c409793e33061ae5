//! Aliased, oversized and indirect descriptor tables through `request::parse` and the
//! executor: see fuzz/drivers/virtio_blk_aliased.rs for the input layout and the checks.
#![no_main]

#[path = "../drivers/virtio_blk_aliased.rs"]
mod driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driver::run(data);
});
