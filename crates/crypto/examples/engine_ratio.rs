//! One engine against another in the same run, in interleaved rounds, per CPU-second of the
//! measuring thread (a shared machine's other load changes wall-clock figures, far less the
//! thread's own CPU time). Prints each round and, per direction, the median of the per-round
//! ratios and the worst round.
//!
//! `cargo run --release -p cryptblk-crypto --example engine_ratio -- [--engines vaes,openssl]
//!  [--bits 512] [--sector 4096] [--buffer 1048576] [--rounds 9] [--ms 100]`

use cryptblk_crypto::{engines, CipherSpec, Direction, SecretKey};
use std::time::{Duration, Instant};

struct Args {
    engines: Vec<String>,
    bits: usize,
    sector: usize,
    buffer: usize,
    rounds: usize,
    ms: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        engines: vec!["vaes".into(), "openssl".into()],
        bits: 512,
        sector: 4096,
        buffer: 1 << 20,
        rounds: 9,
        ms: 100,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || value.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--engines" => a.engines = value.split(',').map(str::to_owned).collect(),
            "--bits" => a.bits = num()?,
            "--sector" => a.sector = num()?,
            "--buffer" => a.buffer = num()?,
            "--rounds" => a.rounds = num()?,
            "--ms" => a.ms = num()? as u64,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if a.engines.len() != 2 {
        return Err("--engines takes two names: the candidate, then the reference".into());
    }
    Ok(a)
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid, writable timespec for the call.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = parse().map_err(|e| {
        format!("{e}\nusage: engine_ratio [--engines A,B] [--bits 256|512] [--sector N] [--buffer BYTES] [--rounds N] [--ms N]")
    })?;
    let spec = CipherSpec::parse_luks2("aes-xts-plain64", a.bits / 8)?;
    let key = SecretKey::random(a.bits / 8)?;
    let ciphers = a
        .engines
        .iter()
        .map(|name| {
            let e = engines()
                .into_iter()
                .find(|e| e.name() == name)
                .ok_or(format!("no engine {name}"))?;
            e.new_cipher(&spec, &key, a.sector)
                .map_err(|err| format!("{name}: {err}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let len = a.buffer / a.sector * a.sector;
    let mut buf = vec![0x5au8; len];
    let budget = Duration::from_millis(a.ms);
    // GB per CPU-second of this thread.
    let mut measure = |i: usize, dir: Direction| {
        let c = &ciphers[i];
        let mut sector = 0u64;
        c.crypt(dir, sector, &mut buf).expect("crypt");
        let (t0, c0) = (Instant::now(), thread_cpu());
        let mut bytes = 0usize;
        while t0.elapsed() < budget {
            c.crypt(dir, sector, &mut buf).expect("crypt");
            sector = sector.wrapping_add((len / a.sector) as u64);
            bytes += len;
        }
        bytes as f64 / (thread_cpu() - c0).as_secs_f64() / 1e9
    };
    println!(
        "aes-xts-plain64 {} bits, {}-byte sectors, {} KiB per call, GB per CPU-second; {} / {}",
        a.bits,
        a.sector,
        len / 1024,
        a.engines[0],
        a.engines[1]
    );
    for dir in [Direction::Encrypt, Direction::Decrypt] {
        let mut ratios = Vec::new();
        for round in 0..a.rounds {
            // Alternate which engine goes first, so a drift in the machine's load favours
            // neither.
            let (x, y) = if round % 2 == 0 {
                let x = measure(0, dir);
                (x, measure(1, dir))
            } else {
                let y = measure(1, dir);
                (measure(0, dir), y)
            };
            println!("  {dir:?} round {round}: {x:.2} / {y:.2} = {:.2}", x / y);
            ratios.push(x / y);
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "{dir:?}: median ratio {:.2}, worst round {:.2}",
            ratios[ratios.len() / 2],
            ratios[0]
        );
    }
    Ok(())
}
