//! `Volume::reencrypt_online`: a served LUKS2 volume's key replaced, paused part-way and
//! continued, and a served raw volume encrypted in place; what the volume serves reads back
//! the same throughout, the supervisor hears the run as it goes, and the image opens with
//! the passphrase afterwards (the key, or the format, changed).
mod common;

use common::{cheap, container, PW};
use cryptblk_crypto::CryptoPool;
use cryptblk_luks::luks2::reencrypt::{EncryptParams, InitParams, ResilienceChoice};
use cryptblk_luks::luks2::Luks2Header;
use cryptblk_luks::{HashAlg, LuksImage, LuksVersion, UnlockOptions, Unlocker};
use cryptblk_volume::{
    Hotzone, Key, NewLayout, OnlineError, OnlineErrorKind, OnlineMode, OnlineOptions, Outcome,
    RunStart, Supervisor, Volume, VolumeKeys, VolumeOptions,
};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;

/// What a supervisor heard, and the pause it asks for after `pause_after` hotzones.
#[derive(Default)]
struct Heard {
    starts: Vec<RunStart>,
    hotzones: Vec<Hotzone>,
    done: Vec<u64>,
    keys: Vec<usize>,
}

struct Recorder<'a> {
    layout: NewLayout<'static>,
    reduce: u64,
    pause: &'a AtomicBool,
    pause_after: Option<usize>,
    heard: Mutex<Heard>,
}

impl<'a> Recorder<'a> {
    fn new(pause: &'a AtomicBool, pause_after: Option<usize>) -> Recorder<'a> {
        Recorder {
            layout: NewLayout {
                key_bits: Some(256),
                ..NewLayout::default()
            },
            reduce: 2 * MIB,
            pause,
            pause_after,
            heard: Mutex::default(),
        }
    }
}

impl Supervisor for Recorder<'_> {
    type Error = OnlineError;

    fn reencryption_params(&self, header: &Luks2Header) -> Result<InitParams, OnlineError> {
        let layout = self.layout.for_reencryption(header)?;
        let resilience = ResilienceChoice::Checksum(HashAlg::Sha256);
        Ok(layout.init_params(resilience, cheap(), None))
    }

    fn encryption_params(&self) -> Result<EncryptParams, OnlineError> {
        let layout = self.layout.for_encryption()?;
        Ok(layout.encrypt_params(HashAlg::Sha256, cheap(), self.reduce))
    }

    fn started(&self, run: RunStart) {
        self.heard.lock().unwrap().starts.push(run);
    }

    fn hotzone(&self, zone: Hotzone) {
        self.heard.lock().unwrap().hotzones.push(zone);
    }

    fn advanced(&self, done: u64) {
        let mut heard = self.heard.lock().unwrap();
        heard.done.push(done);
        if Some(heard.done.len()) == self.pause_after {
            self.pause.store(true, Ordering::Release);
        }
    }

    fn keys_changed(&self, keys: &VolumeKeys) {
        self.heard.lock().unwrap().keys.push(keys.keys.len());
    }
}

fn options<'a>(
    unlock: &'a UnlockOptions,
    pause: &'a AtomicBool,
    max_bandwidth: u64,
) -> OnlineOptions<'a> {
    OnlineOptions {
        name: "vol",
        passphrase: PW,
        unlock,
        pool: Arc::new(CryptoPool::new(2)),
        max_bandwidth,
        pause,
    }
}

fn open_luks(path: &Path) -> Volume {
    let opts = VolumeOptions {
        writable: true,
        ..Default::default()
    };
    Volume::open(container(path), Key::Given(Unlocker::Passphrase(PW), &opts)).unwrap()
}

/// Distinct bytes per 512-byte sector, so a sector served from the wrong place shows.
fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i / 512) as u8 ^ (i % 251) as u8 ^ seed)
        .collect()
}

fn read_all(volume: &Volume) -> Vec<u8> {
    let mut out = vec![0; volume.device.size() as usize];
    volume.device.read_at(&mut out, 0).unwrap();
    out
}

fn in_reencryption(path: &Path) -> bool {
    let file = std::fs::File::open(path).unwrap();
    match LuksImage::read(&file).unwrap().0 {
        LuksImage::V2(h) => h.reencrypt_state().unwrap().is_some(),
        LuksImage::V1(_) => false,
    }
}

#[test]
fn a_served_volume_gets_a_new_key_across_a_pause() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.luks");
    common::luks(&img, LuksVersion::V2, 4 * MIB);
    let unlock = UnlockOptions::default();
    let data = pattern(4 * MIB, 3);
    let volume = open_luks(&img);
    let old_keys = volume.volume_keys().unwrap();
    volume.device.write_at(&data, 0).unwrap();

    // 1 MiB/s: quarter-second hotzones of 256 KiB; the supervisor pauses after the second.
    let pause = AtomicBool::new(false);
    let recorder = Recorder::new(&pause, Some(2));
    let outcome = volume
        .reencrypt_online(
            OnlineMode::Reencrypt,
            &options(&unlock, &pause, MIB),
            &recorder,
        )
        .unwrap();
    assert_eq!(outcome, Outcome::Paused);
    {
        let heard = recorder.heard.lock().unwrap();
        assert_eq!(heard.starts.len(), 1);
        let start = &heard.starts[0];
        assert_eq!(start.mode, OnlineMode::Reencrypt);
        assert_eq!((start.done, start.total), (0, 4 * MIB));
        assert_eq!(start.resilience, "checksum");
        assert_eq!(heard.done, [256 << 10, 512 << 10]);
        assert_eq!(
            heard.hotzones[1],
            Hotzone {
                offset: 256 << 10,
                len: 256 << 10
            }
        );
        assert_eq!(heard.keys, [2], "both keys serve while it runs");
    }
    assert!(volume.segments().is_split());
    assert!(in_reencryption(&img));
    assert_eq!(read_all(&volume), data, "while paused");

    // Continued without a limit: to the end, from the boundary the pause committed.
    pause.store(false, Ordering::Release);
    let recorder = Recorder::new(&pause, None);
    let outcome = volume
        .reencrypt_online(
            OnlineMode::Reencrypt,
            &options(&unlock, &pause, 0),
            &recorder,
        )
        .unwrap();
    assert_eq!(outcome, Outcome::Finished);
    {
        let heard = recorder.heard.lock().unwrap();
        assert_eq!(heard.starts[0].done, 512 << 10);
        assert_eq!(heard.done.last(), Some(&(4 * MIB)));
        assert_eq!(heard.keys, [2, 1], "the new key alone after the finish");
    }
    assert!(!volume.segments().is_split());
    assert_eq!(read_all(&volume), data, "after the finish");
    let new_keys = volume.volume_keys().unwrap();
    assert_eq!(new_keys.keys.len(), 1);
    assert_ne!(
        new_keys.keys[0].key.as_bytes(),
        old_keys.keys[0].key.as_bytes()
    );
    drop(volume);

    assert!(!in_reencryption(&img));
    let volume = open_luks(&img);
    assert_eq!(volume.luks().unwrap().key_bits, 256);
    assert_eq!(read_all(&volume), data, "reopened with the passphrase");
}

#[test]
fn a_served_raw_volume_is_encrypted_in_place_and_keeps_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("disk.raw");
    let data = pattern(4 * MIB, 9);
    std::fs::write(&img, &data).unwrap();
    let unlock = UnlockOptions::default();
    let volume = Volume::open(container(&img), Key::None).unwrap();
    let pause = AtomicBool::new(false);

    // A data shift that is not whole tracking blocks is refused before anything is written.
    let mut odd = Recorder::new(&pause, None);
    odd.reduce = 2 * MIB + 4096;
    let refused = volume
        .reencrypt_online(OnlineMode::Encrypt, &options(&unlock, &pause, 0), &odd)
        .unwrap_err();
    assert_eq!(refused.kind(), OnlineErrorKind::Usage, "{refused}");
    assert!(
        refused.to_string().contains("multiple of 8192"),
        "{refused}"
    );
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 4 * MIB);
    assert!(volume.luks().is_none());

    let recorder = Recorder::new(&pause, None);
    let outcome = volume
        .reencrypt_online(OnlineMode::Encrypt, &options(&unlock, &pause, 0), &recorder)
        .unwrap();
    assert_eq!(outcome, Outcome::Finished);
    {
        let heard = recorder.heard.lock().unwrap();
        let start = &heard.starts[0];
        assert_eq!(start.mode, OnlineMode::Encrypt);
        assert_eq!(start.resilience, "datashift");
        assert_eq!(start.total, 4 * MIB);
        assert_eq!(heard.done.last(), Some(&(4 * MIB)));
        assert_eq!(heard.keys.last(), Some(&1));
    }
    let facts = volume.luks().expect("LUKS2 now");
    assert_eq!(
        (facts.cipher.as_str(), facts.key_bits),
        ("aes-xts-plain64", 256)
    );
    assert_eq!(volume.device.size(), 4 * MIB);
    assert_eq!(read_all(&volume), data, "served after the encryption");
    drop(volume);

    // Header (half the reduction) plus the disk.
    assert_eq!(std::fs::metadata(&img).unwrap().len(), MIB + 4 * MIB);
    assert!(!in_reencryption(&img));
    let volume = open_luks(&img);
    assert_eq!(read_all(&volume), data, "reopened with the passphrase");
}
