//! Resolving the store's `host:port`, telling a name that does not exist (refused at once)
//! from a resolver that does not answer yet (retried until the deadline).

use std::ffi::CString;
use std::net::{SocketAddr, ToSocketAddrs};

/// Why `host:port` gave no address.
#[derive(Debug)]
pub(crate) enum Unresolved {
    /// The resolver says the name does not exist, or has no address: retrying cannot help.
    Unknown {
        /// The host part of the address.
        host: String,
        /// The resolver's words.
        detail: String,
    },
    /// Anything else (no answer from DNS, out of memory): worth another try.
    Passing(String),
}

/// glibc's `EAI_NODATA` ("No address associated with hostname"), which the `libc` crate does
/// not export for Linux.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const EAI_NODATA: libc::c_int = -5;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
const EAI_NODATA: libc::c_int = libc::EAI_NONAME;

/// The first address of `addr` (`host:port`, `[v6]:port`).
pub(crate) fn resolve(addr: &str) -> Result<SocketAddr, Unresolved> {
    let host = host_of(addr);
    match addr.to_socket_addrs() {
        Ok(mut all) => all.next().ok_or_else(|| Unresolved::Unknown {
            host: host.to_string(),
            detail: "it resolves to no address".into(),
        }),
        Err(e) if name_unknown(host) => Err(Unresolved::Unknown {
            host: host.to_string(),
            detail: e.to_string(),
        }),
        Err(e) => Err(Unresolved::Passing(e.to_string())),
    }
}

/// The host part of `host:port` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Whether the resolver says that `host` does not exist or has no address (`EAI_NONAME`,
/// `EAI_NODATA`), as opposed to a failure that may pass (`EAI_AGAIN`: no answer yet).
fn name_unknown(host: &str) -> bool {
    let Ok(name) = CString::new(host) else {
        // A NUL inside: no resolver can know it.
        return true;
    };
    // SAFETY: an all-zero addrinfo is the documented "no hints" value; the fields set below
    // are plain integers.
    let mut hints: libc::addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_socktype = libc::SOCK_STREAM;
    let mut found: *mut libc::addrinfo = std::ptr::null_mut();
    // SAFETY: `name` is a NUL-terminated string that outlives the call, the service may be
    // null, `hints` is initialised and `found` is a valid place for the result list.
    let rc = unsafe { libc::getaddrinfo(name.as_ptr(), std::ptr::null(), &hints, &mut found) };
    if !found.is_null() {
        // SAFETY: `found` came from getaddrinfo and is freed once, here.
        unsafe { libc::freeaddrinfo(found) };
    }
    rc == libc::EAI_NONAME || rc == EAI_NODATA
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_that_does_not_exist_is_told_from_a_passing_failure() {
        assert!(resolve("127.0.0.1:80").is_ok());
        assert!(resolve("localhost:80").is_ok());
        match resolve("no-such-host.invalid:29500") {
            Err(Unresolved::Unknown { host, .. }) => assert_eq!(host, "no-such-host.invalid"),
            // A machine without DNS may answer "try again" for any name: not refused then.
            Err(Unresolved::Passing(_)) => {}
            Ok(a) => panic!("no-such-host.invalid resolved to {a}"),
        }
        assert_eq!(host_of("[::1]:5"), "::1");
        assert_eq!(host_of("h:5"), "h");
    }
}
