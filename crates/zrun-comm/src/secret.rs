//! The per-user secret that multi-node job tokens are derived from.
//!
//! Nodes of one job must present the same store token without talking first. Deriving it from
//! what every node knows (address, port, run id) would let anyone who can reach the port
//! derive it too, so it is keyed with a secret: 32 random bytes (hex) in a file readable only by
//! its owner, `$ZRUN_SECRET_FILE` or `~/.config/zrun/secret`, made on first use. On a cluster
//! whose nodes share the home directory every node reads the same file; elsewhere copy it
//! (mode 0600) or export one `ZRUN_JOB_TOKEN` everywhere. The token is
//! HMAC-SHA256(secret, "zrun job token v1" NUL run id) in hex, so a token seen on the wire
//! names one run id and does not reveal the secret.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::Error;

/// Environment variable naming the secret file (default `~/.config/zrun/secret`).
pub const SECRET_FILE_ENV: &str = "ZRUN_SECRET_FILE";

/// Hex characters a secret file must hold at least (128 bits).
const MIN_SECRET: usize = 32;

/// The secret file: `$ZRUN_SECRET_FILE`, else `$HOME/.config/zrun/secret`.
pub fn secret_path() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => Ok(Path::new(&home).join(".config/zrun/secret")),
        None => Err(Error::Secret {
            path: "~/.config/zrun/secret".into(),
            detail: format!("HOME is not set; set {SECRET_FILE_ENV} to a file every node can read, or export the same ZRUN_JOB_TOKEN on every node"),
        }),
    }
}

/// Reads the secret at `path`, making it (32 random bytes as hex, mode 0600, its directory
/// 0700) when absent. Refuses a file that group or others may read or write, and a short one.
/// Several processes making it at once end up with the same file (it is published with a
/// hard link, which fails when another got there first).
pub fn load_or_create_secret(path: &Path) -> Result<Vec<u8>, Error> {
    let err = |detail: String| Error::Secret {
        path: path.display().to_string(),
        detail,
    };
    match std::fs::metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create(path).map_err(|e| {
            err(format!(
                "cannot create it: {e}; set {SECRET_FILE_ENV} to a writable path, or export the same ZRUN_JOB_TOKEN on every node"
            ))
        })?,
        Err(e) => return Err(err(format!("cannot read it: {e}"))),
    }
    let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(err(format!(
            "group or others may read or write it (mode {mode:03o}); run `chmod 600 {}`",
            path.display()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let secret = text.trim();
    if secret.len() < MIN_SECRET {
        return Err(err(format!(
            "holds {} characters, fewer than {MIN_SECRET}; delete it to have zrun make a new one, then give every node the same file",
            secret.len()
        )));
    }
    Ok(secret.as_bytes().to_vec())
}

/// Writes a new secret beside `path` and links it into place unless another process did first.
fn create(path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    // 32 bytes of secret, 8 more to name the temporary file apart from other makers'.
    let mut raw = [0u8; 40];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
    let (raw, tag) = raw.split_at(32);
    let tmp = path.with_extension(format!("tmp.{}", hex(tag)));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(format!("{}\n", hex(raw)).as_bytes())?;
        f.sync_all()
    })();
    let linked = written.and_then(|()| match std::fs::hard_link(&tmp, path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        // A file system without hard links: rename (a racing process may then win).
        Err(_) => std::fs::rename(&tmp, path),
        Ok(()) => Ok(()),
    });
    let _ = std::fs::remove_file(&tmp);
    linked
}

/// The store token of run `run_id`: hex HMAC-SHA256 keyed with `secret`.
pub fn job_token(secret: &[u8], run_id: &str) -> String {
    let mut msg = b"zrun job token v1\0".to_vec();
    msg.extend_from_slice(run_id.as_bytes());
    hex(&hmac_sha256(secret, &msg))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// HMAC (RFC 2104) over SHA-256.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    use hmac::Mac;
    // HMAC takes a key of any length.
    let mut mac =
        hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC accepts keys of every length");
    mac.update(msg);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_the_published_vectors() {
        // RFC 4231 test cases 2 and 6 (a key longer than a block).
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    fn tmp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("zrun-secret-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_secret_is_made_private_once_and_read_back() {
        let d = tmp_dir("make");
        let p = d.join("sub/secret");
        let a = load_or_create_secret(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = std::fs::metadata(d.join("sub"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        assert_eq!(a.len(), 64);
        assert_eq!(load_or_create_secret(&p).unwrap(), a);
        // Racing makers agree.
        let q = d.join("race/secret");
        let got: Vec<Vec<u8>> = (0..8)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || load_or_create_secret(&q).unwrap())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(got.iter().all(|g| g == &got[0]));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn shared_or_short_secrets_are_refused_with_the_fix() {
        let d = tmp_dir("bad");
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("secret");
        std::fs::write(&p, "0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_or_create_secret(&p).unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        assert!(!e.contains('\n'));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load_or_create_secret(&p).is_ok());
        std::fs::write(&p, "short\n").unwrap();
        let e = load_or_create_secret(&p).unwrap_err().to_string();
        assert!(e.contains("fewer than 32"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn tokens_depend_on_the_secret_and_the_run_id() {
        let (s1, s2) = (b"a".repeat(64), b"b".repeat(64));
        assert_eq!(
            job_token(&s1, "10.0.0.1-29500"),
            job_token(&s1, "10.0.0.1-29500")
        );
        assert_ne!(
            job_token(&s1, "10.0.0.1-29500"),
            job_token(&s2, "10.0.0.1-29500")
        );
        assert_ne!(
            job_token(&s1, "10.0.0.1-29500"),
            job_token(&s1, "10.0.0.1-29501")
        );
        assert_eq!(job_token(&s1, "x").len(), 64);
    }
}
