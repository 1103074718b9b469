//! Mutual TLS on the internal gRPC links (gateway -> coordinator -> workers): the
//! `--tls-cert`, `--tls-key`, `--tls-ca` flags (env `TESSERA_TLS_CERT`/`_KEY`/`_CA`) every
//! role takes, read and checked at start-up into tonic's server and client TLS settings.
//!
//! All three set: a server (coordinator, worker) requires a client certificate signed by
//! the CA; a client (gateway, coordinator) presents its certificate and checks the server's
//! against the CA, under the host it dials (or `--tls-server-name`). None set: plain gRPC.
//! Some but not all set is a start-up error, as is a file that cannot be read or parsed.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The mTLS flags of a role.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsFlags {
    /// mTLS on internal gRPC: this process's certificate (PEM, chain allowed), presented as
    /// server and as client. Needs --tls-key and --tls-ca.
    #[arg(long, env = "TESSERA_TLS_CERT", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// mTLS: the private key of --tls-cert (PEM).
    #[arg(long, env = "TESSERA_TLS_KEY", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// mTLS: the CA (PEM) that signs every cluster certificate; peers must present one.
    #[arg(long, env = "TESSERA_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// mTLS: the name checked in the certificates of the servers this process dials,
    /// instead of the host in their address (e.g. when workers are dialed by pod IP).
    #[arg(long, env = "TESSERA_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

/// Certificates read and checked: makes tonic's TLS settings.
#[derive(Debug, Clone)]
pub struct Tls {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    server_name: Option<String>,
}

impl TlsFlags {
    /// The TLS settings, `None` when no TLS flag is set. Half-configured flags, unreadable
    /// files and files that are not PEM certificates / keys are errors.
    pub fn load(&self) -> Result<Option<Tls>> {
        let (cert, key, ca) = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => {
                if self.tls_server_name.is_some() {
                    bail!("--tls-server-name needs --tls-cert, --tls-key and --tls-ca");
                }
                return Ok(None);
            }
            (Some(c), Some(k), Some(a)) => (c, k, a),
            _ => {
                let missing: Vec<&str> = [
                    ("--tls-cert (TESSERA_TLS_CERT)", self.tls_cert.is_none()),
                    ("--tls-key (TESSERA_TLS_KEY)", self.tls_key.is_none()),
                    ("--tls-ca (TESSERA_TLS_CA)", self.tls_ca.is_none()),
                ]
                .into_iter()
                .filter_map(|(name, absent)| absent.then_some(name))
                .collect();
                bail!("mTLS is half configured: {} missing (set all three or none)", missing.join(", "));
            }
        };
        let tls = Tls {
            cert: read_pem(cert, "--tls-cert", "CERTIFICATE-----")?,
            key: read_pem(key, "--tls-key", "PRIVATE KEY-----")?,
            ca: read_pem(ca, "--tls-ca", "CERTIFICATE-----")?,
            server_name: self.tls_server_name.clone(),
        };
        tls.check()?;
        Ok(Some(tls))
    }
}

/// Reads a PEM file that must hold a block whose header ends with `marker`.
fn read_pem(path: &Path, flag: &str, marker: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).with_context(|| format!("{flag}: reading {}", path.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    if !text.lines().any(|l| l.starts_with("-----BEGIN ") && l.ends_with(marker)) {
        bail!("{flag}: {} holds no PEM {}", path.display(), marker.trim_end_matches('-').to_lowercase());
    }
    Ok(bytes)
}

impl Tls {
    /// Server side: this certificate, and client certificates required, signed by the CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert, &self.key))
            .client_ca_root(Certificate::from_pem(&self.ca))
            .client_auth_optional(false)
    }

    /// Client side: this certificate presented, the server's checked against the CA.
    pub fn client(&self) -> ClientTlsConfig {
        let cfg = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .identity(Identity::from_pem(&self.cert, &self.key));
        match &self.server_name {
            Some(name) => cfg.domain_name(name.clone()),
            None => cfg,
        }
    }

    /// Builds both sides once, so a certificate or key rustls cannot use fails at start-up
    /// rather than on the first connection.
    fn check(&self) -> Result<()> {
        tonic::transport::Server::builder()
            .tls_config(self.server())
            .context("mTLS: --tls-cert / --tls-key / --tls-ca do not make a server TLS configuration")?;
        tonic::transport::Endpoint::from_static("https://localhost")
            .tls_config(self.client())
            .context("mTLS: --tls-cert / --tls-key / --tls-ca do not make a client TLS configuration")?;
        Ok(())
    }
}

/// A gRPC server builder: with `tls`, mutual TLS (client certificates required).
pub fn server_builder(tls: Option<&Tls>) -> Result<tonic::transport::Server> {
    let builder = tonic::transport::Server::builder();
    match tls {
        Some(t) => builder.tls_config(t.server()).context("mTLS server configuration"),
        None => Ok(builder),
    }
}

/// The arguments that pass the same TLS files to a child process.
pub fn child_args(cert: &Path, key: &Path, ca: &Path) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    for (flag, path) in [("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)] {
        out.push(flag.into());
        out.push(path.as_os_str().to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(cert: Option<&Path>, key: Option<&Path>, ca: Option<&Path>) -> TlsFlags {
        TlsFlags {
            tls_cert: cert.map(Path::to_path_buf),
            tls_key: key.map(Path::to_path_buf),
            tls_ca: ca.map(Path::to_path_buf),
            tls_server_name: None,
        }
    }

    #[test]
    fn none_set_is_plain_grpc() {
        assert!(flags(None, None, None).load().unwrap().is_none());
    }

    #[test]
    fn half_configured_is_an_error_naming_what_is_missing() {
        let p = Path::new("/nonexistent/x.pem");
        let e = flags(Some(p), None, None).load().unwrap_err().to_string();
        assert!(e.contains("half configured") && e.contains("--tls-key") && e.contains("--tls-ca"), "{e}");
        assert!(!e.contains("--tls-cert"), "{e}");
        let e = flags(None, Some(p), Some(p)).load().unwrap_err().to_string();
        assert!(e.contains("--tls-cert") && !e.contains("--tls-key"), "{e}");
        let e = TlsFlags { tls_server_name: Some("w".into()), ..TlsFlags::default() }.load().unwrap_err();
        assert!(e.to_string().contains("--tls-server-name"), "{e}");
    }

    #[test]
    fn unreadable_or_wrong_files_are_clear_errors() {
        let dir = crate::certs_cmd::test_dir("tls-flags");
        let files = crate::certs_cmd::make(&dir, &["localhost".to_string()]).unwrap();
        // All good.
        let ok = flags(Some(&files.server_cert), Some(&files.server_key), Some(&files.ca_cert));
        assert!(ok.load().unwrap().is_some());
        // A file that is not there.
        let missing = dir.join("absent.pem");
        let e =
            format!("{:#}", flags(Some(&missing), Some(&files.server_key), Some(&files.ca_cert)).load().unwrap_err());
        assert!(e.contains("--tls-cert") && e.contains("absent.pem"), "{e}");
        // A key where the certificate belongs, and not PEM at all.
        let e = format!(
            "{:#}",
            flags(Some(&files.server_key), Some(&files.server_key), Some(&files.ca_cert)).load().unwrap_err()
        );
        assert!(e.contains("--tls-cert") && e.contains("no PEM certificate"), "{e}");
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let e = format!("{:#}", flags(Some(&files.server_cert), Some(&junk), Some(&files.ca_cert)).load().unwrap_err());
        assert!(e.contains("--tls-key") && e.contains("no PEM private key"), "{e}");
        // PEM framing around garbage: rustls refuses it at start-up.
        let bad = dir.join("bad.pem");
        std::fs::write(&bad, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
        let r = flags(Some(&bad), Some(&files.server_key), Some(&files.ca_cert)).load();
        assert!(r.is_err(), "a broken certificate was accepted");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
