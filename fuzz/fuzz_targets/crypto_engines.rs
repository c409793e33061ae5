//! Every sector-crypto engine the CPU runs against the portable one on fuzzer-chosen keys,
//! sector sizes, sector numbers and misalignments: see fuzz/drivers/crypto_engines.rs.
#![no_main]

#[path = "../drivers/crypto_engines.rs"]
mod driver;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    driver::run(data);
});
