//! Crash safety of keyslot changes: `cryptblk serve` is killed with SIGKILL at any point of a
//! `key-add` or `key-remove` through the control socket and restarted on the same image. The
//! image always opens with the old passphrase, and an operation that reported success is
//! durable.
//!
//! Every test prints its seed and timings; `CRYPTBLK_CRASH_SEED=N` replays a run.
mod common;

use common::crash::*;
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `cryptblk ctl --socket CONTROL ARGS` started in the background. The thread returns
/// Ok(result JSON) when it succeeded, Err(None) when it was cut off (the daemon died before
/// answering, or before it could connect), Err(Some(stderr)) when the daemon refused it.
fn ctl_in_background(
    control: &Path,
    args: Vec<String>,
) -> (
    Instant,
    std::thread::JoinHandle<Result<Value, Option<String>>>,
) {
    let child = Command::new(bin())
        .args(["ctl", "--socket", s(control)])
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("RUST_LOG")
        .spawn()
        .expect("running cryptblk ctl");
    let started = Instant::now();
    let handle = std::thread::spawn(move || {
        let out = child.wait_with_output().expect("waiting for cryptblk ctl");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            return Ok(serde_json::from_str(&stdout).unwrap_or_else(|e| {
                panic!("cryptblk ctl {args:?}: output is not JSON ({e}): {stdout:?}")
            }));
        }
        // The daemon's own refusals name the JSON-RPC error; anything else is the connection
        // going away (or never being made) because the daemon was killed.
        if stderr.contains("JSON-RPC error") {
            Err(Some(stderr))
        } else {
            eprintln!("  (ctl cut off: {})", stderr.trim());
            Err(None)
        }
    });
    (started, handle)
}

/// Runs `cryptblk ctl ARGS` to completion (no kill); returns its duration.
fn ctl_timed(control: &Path, args: Vec<String>) -> Duration {
    let what = format!("{args:?}");
    let (t, h) = ctl_in_background(control, args);
    let r = h.join().unwrap();
    let took = t.elapsed();
    r.unwrap_or_else(|e| panic!("cryptblk ctl {what} failed: {e:?}"));
    took
}

fn opens_with_cryptsetup(img: &Path, key: &Path) -> bool {
    cryptsetup_accepts(img, key)
}

/// The state of the image after a kill: both parsers accept the header, the old passphrase
/// opens it with cryptsetup and with cryptblk (which decrypts the payload we wrote), and the
/// number of keyslots matches the passphrases that open it. Returns whether `other` opens it.
#[track_caller]
fn check_image(
    dir: &Path,
    img: &Path,
    old: &Path,
    other: &Path,
    payload: &[u8],
    context: &str,
    removing: bool,
) -> bool {
    let dump = tool("cryptsetup", ["luksDump", s(img)]);
    assert_eq!(
        dump.code, 0,
        "cryptsetup luksDump fails {context}:\n{dump:?}"
    );
    let json = cryptblk(["dump", "--json", s(img)]);
    assert_eq!(json.code, 0, "cryptblk dump fails {context}:\n{json:?}");
    let json: Value = serde_json::from_str(&json.stdout).unwrap();
    assert!(
        opens_with_cryptsetup(img, old),
        "the old passphrase no longer opens the image (cryptsetup) {context}\n{}",
        dump.stdout
    );
    let out = dir.join("check.raw");
    let _ = std::fs::remove_file(&out);
    let conv = cryptblk(argv!(
        "convert -O raw --source-key-file {} {} {}",
        old,
        img,
        out
    ));
    assert_eq!(
        conv.code, 0,
        "cryptblk cannot open the image with the old passphrase {context}:\n{conv:?}"
    );
    assert_same_bytes(
        &read(&out)[..payload.len()],
        payload,
        &format!("payload {context}"),
    );
    let other_opens = opens_with_cryptsetup(img, other);
    let keyslots = json["keyslots"].as_array().unwrap();
    let slots = keyslots.len();
    if removing && !other_opens && slots == 2 {
        // A key-remove killed between wiping the slot's key material and writing the header
        // without it (cryptsetup's order: the material must be gone even if the header
        // write never happens): the removed passphrase opens nothing, the slot is still
        // listed. Kill it with the old passphrase, as an operator would, for the next round.
        // The old passphrase's slot is 0 (format); the added one is the other.
        let dead = keyslots
            .iter()
            .filter_map(|k| k["id"].as_str())
            .find(|&id| id != "0")
            .unwrap_or_else(|| panic!("no keyslot but 0 listed {context}"))
            .to_owned();
        let kill = tool(
            "cryptsetup",
            ["luksKillSlot", "-q", "--key-file", s(old), s(img), &dead],
        );
        assert_eq!(
            kill.code, 0,
            "cannot kill the dead keyslot {dead} {context}:\n{kill:?}"
        );
        return false;
    }
    assert_eq!(
        slots,
        1 + usize::from(other_opens),
        "{slots} keyslots, but only {} passphrases open the image {context}\n{}",
        1 + usize::from(other_opens),
        dump.stdout
    );
    other_opens
}

/// Kill delays for an operation that takes about `t` uninterrupted: the first rounds spread
/// over [0, 1.25 t]; later ones bisect between the latest kill that came before the operation
/// took effect and the earliest one after it, so they land where the header is being written.
struct KillDelays {
    t: Duration,
    before: Option<Duration>,
    after: Option<Duration>,
}

impl KillDelays {
    const SPREAD: [f64; 3] = [0.0, 0.6, 1.25];

    fn new(t: Duration) -> KillDelays {
        KillDelays {
            t,
            before: None,
            after: None,
        }
    }

    fn next(&self, round: usize, rng: &mut StdRng) -> Duration {
        let jitter = |width: Duration, rng: &mut StdRng| {
            Duration::from_micros(rng.gen_range(0..=width.as_micros() as u64 + 1))
        };
        if let Some(f) = Self::SPREAD.get(round) {
            return self.t.mul_f64(*f) + jitter(self.t / 8, rng);
        }
        match (self.before, self.after) {
            (Some(b), Some(a)) if b < a => {
                let w = (a - b) / 4;
                b + (a - b) / 2 - w / 2 + jitter(w, rng)
            }
            // Timing noise (a later kill before, an earlier one after): around both.
            (Some(b), Some(a)) => {
                let lo = a.saturating_sub(self.t / 10);
                lo + jitter(b - a + self.t / 5, rng)
            }
            // Every kill so far came before the effect (the machine is slower than during
            // calibration): go later.
            (Some(b), None) => b.mul_f64(1.5) + jitter(self.t / 8, rng),
            // Every kill so far came after it: go earlier.
            (None, Some(a)) => jitter(a / 2, rng),
            (None, None) => jitter(self.t.mul_f64(1.25), rng),
        }
    }

    fn record(&mut self, killed_at: Duration, took_effect: bool) {
        if took_effect {
            self.after = Some(self.after.map_or(killed_at, |a| a.min(killed_at)));
        } else {
            self.before = Some(self.before.map_or(killed_at, |b| b.max(killed_at)));
        }
    }
}

/// `key-add` and `key-remove` on an attached LUKS2 disk, with the daemon SIGKILLed at delays
/// spread over the time the operation takes, then converging on the moment it takes effect: the old passphrase always opens the image, both
/// cryptsetup and cryptblk accept the header, and a reported success is durable.
#[test]
fn key_add_survives_kill_9_at_any_point() {
    const ROUNDS: usize = 12;
    let seed = seed_for("key_add_survives_kill_9_at_any_point");
    let mut rng = StdRng::seed_from_u64(seed);
    let t = TestDir::new();
    let d = t.root();
    let old = t.key("old");
    let img = t.luks2("keys.luks", "4M", &old);
    let name = "keys";

    // A payload to recognise, and the durations of an uninterrupted key-add and key-remove.
    let payload: Vec<u8> = (0..64u64).flat_map(|b| record(b, 1)).collect();
    let cal_key = t.key("cal");
    let mut daemon = t.serve().disk(&img).name(name).nbd().control().start();
    let mut c = daemon.nbd(name);
    c.write(0, &payload, true).unwrap();
    c.disconnect().unwrap();
    let ctl = daemon.control().to_path_buf();
    // Cheap, but calibrated: the KDF benchmark runs inside the daemon like in production.
    let add_args = |new: &Path| -> Vec<String> {
        let a = [
            "key-add",
            name,
            "--key-file",
            s(&old),
            "--new-key-file",
            s(new),
        ];
        let cheap = ["--pbkdf", "pbkdf2", "--iter-time", "30"];
        a.iter().chain(&cheap).map(|x| x.to_string()).collect()
    };
    let remove_args = |key: &Path| -> Vec<String> {
        ["key-remove", name, "--key-file", s(key)]
            .iter()
            .map(|x| x.to_string())
            .collect()
    };
    let t_add = ctl_timed(&ctl, add_args(&cal_key));
    let t_remove = ctl_timed(&ctl, remove_args(&cal_key));
    assert_eq!(daemon.terminate(), code::OK);
    eprintln!("uninterrupted: key-add {t_add:?}, key-remove {t_remove:?}");
    check_image(
        d,
        &img,
        &old,
        &cal_key,
        &payload,
        "after calibration",
        false,
    );
    assert!(!opens_with_cryptsetup(&img, &cal_key));

    let mut add_delays = KillDelays::new(t_add);
    let mut remove_delays = KillDelays::new(t_remove);
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        let new = t.key(&format!("new{round}"));
        // key-add, killed.
        let delay = add_delays.next(round, &mut rng);
        daemon.restart();
        let (started, h) = ctl_in_background(&ctl, add_args(&new));
        std::thread::sleep(delay.saturating_sub(started.elapsed()));
        let killed_at = started.elapsed();
        daemon.kill9();
        let result = h.join().unwrap();
        let context = format!(
            "(seed {seed}, round {round}: key-add killed {killed_at:?} after starting `cryptblk ctl`, \
             uninterrupted it takes {t_add:?}; reply {result:?})"
        );
        if let Err(Some(e)) = &result {
            panic!("key-add failed instead of succeeding or being cut off: {e} {context}");
        }
        let new_opens = check_image(d, &img, &old, &new, &payload, &context, false);
        if result.is_ok() {
            assert!(
                new_opens,
                "key-add reported success but the new passphrase does not open the image {context}"
            );
        }
        eprintln!("round {round}: key-add killed at {killed_at:?}: replied {}, new key opens: {new_opens}", result.is_ok());
        add_delays.record(killed_at, new_opens);
        outcomes.push(("add", killed_at, result.is_ok(), new_opens));

        // Make sure there is a second keyslot to remove.
        if !new_opens {
            let add = "key add --key-file {} --new-key-file {} {}";
            cryptblk_cheap(argv!(add, old, new, img)).ok();
        }

        // key-remove of that slot, killed.
        let delay = remove_delays.next(round, &mut rng);
        daemon.restart();
        let (started, h) = ctl_in_background(&ctl, remove_args(&new));
        std::thread::sleep(delay.saturating_sub(started.elapsed()));
        let killed_at = started.elapsed();
        daemon.kill9();
        let result = h.join().unwrap();
        let context = format!(
            "(seed {seed}, round {round}: key-remove killed {killed_at:?} after starting `cryptblk ctl`, \
             uninterrupted it takes {t_remove:?}; reply {result:?})"
        );
        if let Err(Some(e)) = &result {
            panic!("key-remove failed instead of succeeding or being cut off: {e} {context}");
        }
        let new_opens = check_image(d, &img, &old, &new, &payload, &context, true);
        if result.is_ok() {
            assert!(!new_opens, "key-remove reported success but the removed passphrase still opens the image {context}");
        }
        eprintln!("round {round}: key-remove killed at {killed_at:?}: replied {}, removed key still opens: {new_opens}", result.is_ok());
        remove_delays.record(killed_at, !new_opens);
        outcomes.push(("remove", killed_at, result.is_ok(), new_opens));
        if new_opens {
            cryptblk(["key", "remove", "--key-file", s(&new), s(&img)]).ok();
        }
    }
    // Not vacuous: some kills landed before the reply, and some operations completed.
    let cut = outcomes.iter().filter(|o| !o.2).count();
    let done = outcomes.iter().filter(|o| o.2).count();
    let effect_without_reply = outcomes
        .iter()
        .filter(|o| !o.2 && (o.3 == (o.0 == "add")))
        .count();
    eprintln!(
        "{cut} operations cut off ({effect_without_reply} of them had taken effect), {done} \
         completed before the kill; add kills converged on {:?}..{:?}, remove kills on {:?}..{:?}",
        add_delays.before, add_delays.after, remove_delays.before, remove_delays.after
    );
    assert!(cut > 0, "no kill interrupted an operation: {outcomes:?}");
    assert!(
        done > 0,
        "no operation completed before its kill: {outcomes:?}"
    );
}
