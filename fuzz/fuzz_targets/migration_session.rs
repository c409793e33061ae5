//! Frame sequences against a real destination session: see fuzz/drivers/migration_session.rs
//! for the input layout and the checks.
#![no_main]

#[path = "../drivers/migration_session.rs"]
mod driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driver::run(data);
});
