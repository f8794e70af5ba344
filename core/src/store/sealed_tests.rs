//! A store whose records are partly sealed (docs/at-rest.md): plain state sealed in place,
//! nothing secret in the snapshot or the logs, the rest readable without the key, and
//! another key, no key and a changed or moved value refused.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use zeroize::Zeroizing;

use super::*;
use crate::sealed::{SealError, StateKey, ValueSealer};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rec {
    public: u32,
    secret: String,
}

/// Seals `secret`, bound to the record's key.
struct SealSecret(ValueSealer);

impl Seal<Rec> for SealSecret {
    fn key_id(&self) -> &str {
        self.0.key_id()
    }
    fn seal(&self, key: &str, v: &Rec) -> Rec {
        Rec {
            public: v.public,
            secret: self.0.seal(&[key], v.secret.as_bytes()),
        }
    }
    fn open(&self, key: &str, v: Rec) -> Result<Rec, String> {
        let plain = self.0.open(&[key], &v.secret).ok_or("secret")?;
        Ok(Rec {
            public: v.public,
            secret: String::from_utf8(plain.to_vec()).map_err(|_| "secret")?,
        })
    }
}

fn sealing(byte: u8, path: &Path) -> Sealing<Rec> {
    let key = StateKey::from_bytes(Zeroizing::new([byte; 32]), Path::new("test"));
    Sealing::With(Arc::new(SealSecret(key.value_sealer(path))))
}

fn seal_of(byte: u8, path: &Path) -> Arc<dyn Seal<Rec>> {
    match sealing(byte, path) {
        Sealing::With(s) => s,
        _ => unreachable!(),
    }
}

fn open(path: &Path, s: Sealing<Rec>) -> Result<Store<Rec>, LoadError> {
    Store::open_with(path, "entries", false, s).map(|(store, _)| store)
}

fn rec(n: u32) -> Rec {
    Rec {
        public: n,
        secret: format!("hunter{n}-secret"),
    }
}

/// Every file of the store, as bytes: none may hold a secret.
fn no_secret_on_disk(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let bytes = std::fs::read(e.path()).unwrap();
        assert!(
            !bytes.windows(6).any(|w| w == b"hunter"),
            "{} holds a secret: {}",
            e.path().display(),
            String::from_utf8_lossy(&bytes)
        );
    }
}

#[tokio::test]
async fn plain_state_is_sealed_in_place_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let plain = open(&path, Sealing::WithoutKey).unwrap();
    plain
        .change_durable_now(|c| {
            c.put("a", rec(1));
            c.put("b", rec(2));
        })
        .await;
    drop(plain);
    assert!(std::fs::read_to_string(dir.path().join("s.log.1"))
        .unwrap()
        .contains("hunter1"));

    // With a key: sealed in place at the start, then every change is sealed as logged.
    let store = open(&path, sealing(1, &path)).unwrap();
    let snap: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(snap["version"], 3);
    assert_eq!(snap["sealed"], crate::sealed::VALUE_FORMAT);
    assert_eq!(snap["entries"]["a"]["public"], 1, "the rest stays plain");
    assert_eq!(store.read(|m| m["a"].clone()), rec(1));
    store.change_durable_now(|c| c.put("c", rec(3))).await;
    no_secret_on_disk(dir.path());
    drop(store);
    let again = open(&path, sealing(1, &path)).unwrap();
    assert_eq!(again.read(|m| m["c"].clone()), rec(3));
    drop(again);
    no_secret_on_disk(dir.path());

    // A look without the key reads what is plain; the secrets stay sealed.
    let view = Store::<Rec>::view(&path, "entries").unwrap();
    assert_eq!(view["b"].public, 2);
    assert_ne!(view["b"].secret, rec(2).secret);
}

#[tokio::test]
async fn another_key_no_key_and_a_moved_value_are_refused_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    let store = open(&path, sealing(1, &path)).unwrap();
    store
        .change_durable_now(|c| {
            c.put("a", rec(1));
            c.put("b", rec(2));
        })
        .await;
    drop(store);
    drop(open(&path, sealing(1, &path)).unwrap()); // folds the log
    let before = std::fs::read(&path).unwrap();

    let e = open(&path, sealing(2, &path)).err().unwrap();
    assert!(
        matches!(e, LoadError::Sealed(SealError::OtherKey { .. })),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("s.json is sealed with the state key"),
        "{e}"
    );
    let e = open(&path, Sealing::WithoutKey).err().unwrap();
    assert!(
        matches!(e, LoadError::Sealed(SealError::NoKey { .. })),
        "{e}"
    );
    // A store that is never sealed refuses it by its version, as the release before does.
    let e = open(&path, Sealing::Never).err().unwrap().to_string();
    assert!(
        e.contains("format version 3; this release reads versions [1, 2]"),
        "{e}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before, "nothing changed");

    // One record's sealed secret put in another's place: it does not open there.
    let mut snap: serde_json::Value = serde_json::from_slice(&before).unwrap();
    snap["entries"]["b"]["secret"] = snap["entries"]["a"]["secret"].clone();
    let moved = serde_json::to_vec(&snap).unwrap();
    std::fs::write(&path, &moved).unwrap();
    let e = open(&path, sealing(1, &path)).err().unwrap().to_string();
    assert!(
        e.contains("s.json: entries.b.secret: authentication of the sealed contents failed"),
        "{e}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), moved, "nothing changed");
    // A sealed file copied to another path does not open there either.
    let elsewhere = dir.path().join("other");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("s.json"), &before).unwrap();
    let e = open(
        &elsewhere.join("s.json"),
        sealing(1, &elsewhere.join("s.json")),
    )
    .err()
    .unwrap();
    assert!(
        matches!(e, LoadError::Sealed(SealError::Tampered { .. })),
        "{e}"
    );

    // Recovering keeps what opens and lists the rest.
    let (store, recovery) = Store::open_with(&path, "entries", true, sealing(1, &path)).unwrap();
    let recovery = recovery.unwrap();
    assert_eq!(store.read(|m| m.keys().cloned().collect::<Vec<_>>()), ["a"]);
    assert_eq!(recovery.skipped.len(), 1, "{:?}", recovery.skipped);
}

#[tokio::test]
async fn reseal_moves_everything_to_the_new_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.json");
    assert_eq!(
        reseal(&path, "entries", sealing(1, &path), seal_of(2, &path)).unwrap(),
        Resealed::Absent
    );
    let store = open(&path, Sealing::WithoutKey).unwrap();
    store.change_durable_now(|c| c.put("a", rec(1))).await;
    drop(store);
    assert_eq!(
        reseal(&path, "entries", Sealing::WithoutKey, seal_of(2, &path)).unwrap(),
        Resealed::Plain
    );
    let store = open(&path, sealing(1, &path)).unwrap();
    store.change_durable_now(|c| c.put("b", rec(2))).await;
    drop(store);
    // The old key is needed to read it; the logs are folded into the new snapshot.
    assert!(reseal(&path, "entries", Sealing::WithoutKey, seal_of(2, &path)).is_err());
    assert_eq!(
        reseal(&path, "entries", sealing(1, &path), seal_of(2, &path)).unwrap(),
        Resealed::Resealed
    );
    assert_eq!(
        reseal(&path, "entries", sealing(1, &path), seal_of(2, &path)).unwrap(),
        Resealed::Already
    );
    no_secret_on_disk(dir.path());
    assert!(open(&path, sealing(1, &path)).is_err());
    let store = open(&path, sealing(2, &path)).unwrap();
    assert_eq!(
        store.read(|m| m.values().cloned().collect::<Vec<_>>()),
        [rec(1), rec(2)]
    );
}
