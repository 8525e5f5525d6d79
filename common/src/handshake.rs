//! The cluster-key handshake that opens every connection.
//!
//! Both sides prove knowledge of the key from `settings/cluster.key` without
//! sending it, and the client says what the connection is for:
//!
//! ```text
//! client -> server  Hello     MAGIC, version u16, role u16, client nonce [32]       (40 bytes)
//! server -> client  Challenge MAGIC, status u16, 0u16, server nonce [32], proof [32] (72 bytes)
//! client -> server  Proof     proof [32]                                            (32 bytes)
//! server -> client  Verdict   status u16, 0u16                                      (4 bytes)
//! ```
//!
//! A proof is `blake3::keyed_hash(key, label || client_nonce || server_nonce || role)`
//! with a different label for each side, so neither side's proof can be replayed
//! as the other's, and fresh nonces make every connection's proofs different.
//! The client checks the server's proof too: a client never sends parameters
//! to, or trusts bytes from, a server outside the cluster.

use std::io::{Read, Write};
use std::time::Duration;

use rand::RngCore;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::wire::{Role, MAGIC, PROTOCOL_VERSION};

/// A server gives a client this long to finish the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const HELLO_BYTES: usize = 40;
const CHALLENGE_BYTES: usize = 72;
const PROOF_BYTES: usize = 32;
const VERDICT_BYTES: usize = 4;

const STATUS_OK: u16 = 0;
const STATUS_BAD_VERSION: u16 = 1;
const STATUS_BAD_ROLE: u16 = 2;
const STATUS_WRONG_KEY: u16 = 3;

/// The 32-byte key both sides derive from the cluster's secret text.
#[derive(Clone)]
pub struct ClusterKey([u8; 32]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<secret>)")
    }
}

impl ClusterKey {
    /// Derives the key from the secret (the trimmed text of `cluster.key`).
    pub fn from_secret(secret: &[u8]) -> Self {
        ClusterKey(blake3::derive_key("distmind-rs cluster key v1", secret))
    }

    fn proof(
        &self,
        label: &[u8],
        client_nonce: &[u8; 32],
        server_nonce: &[u8; 32],
        role: u16,
    ) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(label);
        h.update(client_nonce);
        h.update(server_nonce);
        h.update(&role.to_le_bytes());
        h.finalize()
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    #[error("peer is not a distmind endpoint (bad magic {0:02x?})")]
    NotDistmind([u8; 4]),
    #[error("protocol version mismatch: ours is {ours}, the peer's is {theirs}")]
    Version { ours: u16, theirs: u16 },
    #[error("peer asked for unknown connection role {0}")]
    BadRole(u16),
    #[error(
        "the server refused our cluster key: check that settings/cluster.key matches the cluster's"
    )]
    RefusedByServer,
    #[error("the server did not prove knowledge of the cluster key: it is not part of this cluster (or settings/cluster.key differs)")]
    ServerNotInCluster,
    #[error("the client did not prove knowledge of the cluster key")]
    WrongKey,
    #[error("handshake did not finish within {0:?}")]
    Timeout(Duration),
    #[error("i/o error during handshake: {0}")]
    Io(#[from] std::io::Error),
}

fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

fn hello(role: Role, client_nonce: &[u8; 32]) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[0..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[6..8].copy_from_slice(&(role as u16).to_le_bytes());
    b[8..40].copy_from_slice(client_nonce);
    b
}

/// What the server makes of a hello: the role, or the status to refuse with.
fn check_hello(b: &[u8; HELLO_BYTES]) -> Result<(Role, [u8; 32]), (u16, HandshakeError)> {
    let magic: [u8; 4] = b[0..4].try_into().unwrap();
    if magic != MAGIC {
        return Err((STATUS_BAD_VERSION, HandshakeError::NotDistmind(magic)));
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != PROTOCOL_VERSION {
        return Err((
            STATUS_BAD_VERSION,
            HandshakeError::Version {
                ours: PROTOCOL_VERSION,
                theirs: version,
            },
        ));
    }
    let role_raw = u16::from_le_bytes([b[6], b[7]]);
    let role =
        Role::from_u16(role_raw).ok_or((STATUS_BAD_ROLE, HandshakeError::BadRole(role_raw)))?;
    Ok((role, b[8..40].try_into().unwrap()))
}

fn challenge(status: u16, server_nonce: &[u8; 32], proof: &[u8; 32]) -> [u8; CHALLENGE_BYTES] {
    let mut b = [0u8; CHALLENGE_BYTES];
    b[0..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&status.to_le_bytes());
    b[8..40].copy_from_slice(server_nonce);
    b[40..72].copy_from_slice(proof);
    b
}

/// The client's side of a challenge: the proof to send back.
fn answer_challenge(
    key: &ClusterKey,
    role: Role,
    client_nonce: &[u8; 32],
    b: &[u8; CHALLENGE_BYTES],
) -> Result<[u8; 32], HandshakeError> {
    let magic: [u8; 4] = b[0..4].try_into().unwrap();
    if magic != MAGIC {
        return Err(HandshakeError::NotDistmind(magic));
    }
    match u16::from_le_bytes([b[4], b[5]]) {
        STATUS_OK => {}
        STATUS_BAD_ROLE => return Err(HandshakeError::BadRole(role as u16)),
        _ => {
            return Err(HandshakeError::Version {
                ours: PROTOCOL_VERSION,
                theirs: 0,
            })
        }
    }
    let server_nonce: [u8; 32] = b[8..40].try_into().unwrap();
    let server_proof: [u8; 32] = b[40..72].try_into().unwrap();
    // blake3::Hash compares in constant time.
    if key.proof(b"server", client_nonce, &server_nonce, role as u16)
        != blake3::Hash::from(server_proof)
    {
        return Err(HandshakeError::ServerNotInCluster);
    }
    Ok(*key
        .proof(b"client", client_nonce, &server_nonce, role as u16)
        .as_bytes())
}

fn verdict(status: u16) -> [u8; VERDICT_BYTES] {
    let mut b = [0u8; VERDICT_BYTES];
    b[0..2].copy_from_slice(&status.to_le_bytes());
    b
}

fn check_verdict(b: &[u8; VERDICT_BYTES]) -> Result<(), HandshakeError> {
    match u16::from_le_bytes([b[0], b[1]]) {
        STATUS_OK => Ok(()),
        _ => Err(HandshakeError::RefusedByServer),
    }
}

/// A blocking TCP connection to the first address `addr` resolves to that
/// accepts within `timeout`, with no delay, and `timeout` on every read and
/// write (the handshake, [`client_sync`], comes next). The error is the
/// last address's.
pub fn dial_sync(addr: &str, timeout: Duration) -> std::io::Result<std::net::TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = std::io::Error::new(
        std::io::ErrorKind::NotFound,
        "the address resolved to nothing",
    );
    for sa in addr.to_socket_addrs()? {
        match std::net::TcpStream::connect_timeout(&sa, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))?;
                return Ok(s);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Client side over a blocking stream (set a read timeout on it first).
pub fn client_sync<S: Read + Write>(
    s: &mut S,
    key: &ClusterKey,
    role: Role,
) -> Result<(), HandshakeError> {
    let client_nonce = nonce();
    s.write_all(&hello(role, &client_nonce))?;
    let mut c = [0u8; CHALLENGE_BYTES];
    s.read_exact(&mut c)?;
    let proof = answer_challenge(key, role, &client_nonce, &c)?;
    s.write_all(&proof)?;
    let mut v = [0u8; VERDICT_BYTES];
    s.read_exact(&mut v)?;
    check_verdict(&v)
}

/// Client side over an async stream, bounded by [`HANDSHAKE_TIMEOUT`].
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &ClusterKey,
    role: Role,
) -> Result<(), HandshakeError> {
    let run = async {
        let client_nonce = nonce();
        s.write_all(&hello(role, &client_nonce)).await?;
        let mut c = [0u8; CHALLENGE_BYTES];
        s.read_exact(&mut c).await?;
        let proof = answer_challenge(key, role, &client_nonce, &c)?;
        s.write_all(&proof).await?;
        let mut v = [0u8; VERDICT_BYTES];
        s.read_exact(&mut v).await?;
        check_verdict(&v)
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| HandshakeError::Timeout(HANDSHAKE_TIMEOUT))?
}

/// Server side: returns the role the client asked for, or why it was refused
/// (the client is told before the error is returned). Bounded by
/// [`HANDSHAKE_TIMEOUT`] so a silent client cannot hold a connection slot.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &ClusterKey,
) -> Result<Role, HandshakeError> {
    let run = async {
        let mut h = [0u8; HELLO_BYTES];
        s.read_exact(&mut h).await?;
        let (role, client_nonce) = match check_hello(&h) {
            Ok(v) => v,
            Err((status, err)) => {
                let _ = s.write_all(&challenge(status, &[0; 32], &[0; 32])).await;
                return Err(err);
            }
        };
        let server_nonce = nonce();
        let proof = key.proof(b"server", &client_nonce, &server_nonce, role as u16);
        s.write_all(&challenge(STATUS_OK, &server_nonce, proof.as_bytes()))
            .await?;
        let mut p = [0u8; PROOF_BYTES];
        s.read_exact(&mut p).await?;
        if key.proof(b"client", &client_nonce, &server_nonce, role as u16) != blake3::Hash::from(p)
        {
            let _ = s.write_all(&verdict(STATUS_WRONG_KEY)).await;
            return Err(HandshakeError::WrongKey);
        }
        s.write_all(&verdict(STATUS_OK)).await?;
        Ok(role)
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| HandshakeError::Timeout(HANDSHAKE_TIMEOUT))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dial_tries_every_address_a_name_resolves_to() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // `localhost` may resolve to ::1 first, where nothing listens.
        let s = dial_sync(&format!("localhost:{port}"), Duration::from_secs(5)).unwrap();
        assert_eq!(s.peer_addr().unwrap().port(), port);
        assert!(s.nodelay().unwrap());
        assert_eq!(s.read_timeout().unwrap(), Some(Duration::from_secs(5)));
        drop(l);
        let e = dial_sync(&format!("127.0.0.1:{port}"), Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    async fn pair(
        client_key: &[u8],
        server_key: &[u8],
        role: Role,
    ) -> (Result<(), HandshakeError>, Result<Role, HandshakeError>) {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let ck = ClusterKey::from_secret(client_key);
        let sk = ClusterKey::from_secret(server_key);
        tokio::join!(client(&mut a, &ck, role), server(&mut b, &sk))
    }

    #[tokio::test]
    async fn same_key_succeeds_with_role() {
        let (c, s) = pair(b"secret-secret-secret", b"secret-secret-secret", Role::Data).await;
        c.unwrap();
        assert_eq!(s.unwrap(), Role::Data);
    }

    #[tokio::test]
    async fn wrong_key_is_refused_on_both_sides() {
        let (c, s) = pair(
            b"client-key-xxxxxxxxx",
            b"server-key-yyyyyyyyy",
            Role::Control,
        )
        .await;
        // The client notices first: the server cannot prove the client's key.
        assert!(
            matches!(c, Err(HandshakeError::ServerNotInCluster)),
            "{c:?}"
        );
        assert!(s.is_err());
    }

    #[tokio::test]
    async fn server_refuses_a_client_with_the_wrong_proof() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let sk = ClusterKey::from_secret(b"the-real-key-0123456");
        let srv = tokio::spawn(async move { server(&mut b, &sk).await });
        let n = [7u8; 32];
        a.write_all(&hello(Role::Control, &n)).await.unwrap();
        let mut c = [0u8; CHALLENGE_BYTES];
        a.read_exact(&mut c).await.unwrap();
        a.write_all(&[0u8; 32]).await.unwrap();
        let mut v = [0u8; VERDICT_BYTES];
        a.read_exact(&mut v).await.unwrap();
        assert!(matches!(
            check_verdict(&v),
            Err(HandshakeError::RefusedByServer)
        ));
        assert!(matches!(srv.await.unwrap(), Err(HandshakeError::WrongKey)));
    }

    #[tokio::test]
    async fn garbage_hello_is_not_distmind() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let sk = ClusterKey::from_secret(b"the-real-key-0123456");
        a.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012")
            .await
            .unwrap();
        assert!(matches!(
            server(&mut b, &sk).await,
            Err(HandshakeError::NotDistmind(_))
        ));
    }

    #[test]
    fn sync_client_against_async_server() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let key = ClusterKey::from_secret(b"shared-secret-000000");
        let k2 = key.clone();
        let t = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            client_sync(&mut s, &k2, Role::Control)
        });
        let (s, _) = listener.accept().unwrap();
        s.set_nonblocking(true).unwrap();
        let role = rt.block_on(async {
            let mut s = tokio::net::TcpStream::from_std(s).unwrap();
            server(&mut s, &key).await
        });
        assert_eq!(role.unwrap(), Role::Control);
        t.join().unwrap().unwrap();
    }
}
