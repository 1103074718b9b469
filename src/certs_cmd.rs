//! `tessera certs`: a development CA and certificates for mTLS between the roles (see
//! tls.rs), made with rcgen. Writes into `--out`:
//! - `ca.pem`, `ca.key`: the CA (keep `ca.key` away from the cluster; only `ca.pem` is
//!   deployed);
//! - `server.pem`, `server.key`: for coordinators and workers (server and client
//!   authentication; its names are `--hosts`, which must include every host they are
//!   dialed by, unless the clients set `--tls-server-name`);
//! - `client.pem`, `client.key`: for gateways (client authentication only).
//!
//! For production, issue certificates from your own CA (cert-manager, Vault, ...) with the
//! same uses; these are for development and tests.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// Make a development CA and certificates for mTLS.
#[derive(Debug, Args)]
pub struct CertsArgs {
    /// Directory to write ca.pem, ca.key, server.pem, server.key, client.pem, client.key.
    #[arg(long)]
    pub out: PathBuf,
    /// Names (DNS names or IP addresses) of the server certificate, comma separated: every
    /// host coordinators and workers are dialed by.
    #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1,::1")]
    pub hosts: Vec<String>,
}

/// The files `make` wrote.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub ca_cert: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl CertFiles {
    /// The file names `make` uses under `dir` (what `tessera serve --tls-dir` reads).
    pub fn in_dir(dir: &Path) -> Self {
        CertFiles {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        }
    }
}

pub fn run(args: CertsArgs) -> Result<()> {
    let hosts: Vec<String> = args.hosts.iter().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()).collect();
    let files = make(&args.out, &hosts)?;
    println!("CA:     {}", files.ca_cert.display());
    println!("server: {} {} (names: {})", files.server_cert.display(), files.server_key.display(), hosts.join(", "));
    println!("client: {} {}", files.client_cert.display(), files.client_key.display());
    Ok(())
}

/// Makes a new CA under `out` and a server (names `hosts`) and a client certificate signed
/// by it; returns where they are.
pub fn make(out: &Path, hosts: &[String]) -> Result<CertFiles> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "Tessera development CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA certificate")?;
    let files = CertFiles::in_dir(out);
    write(&files.ca_cert, &ca_cert.pem(), false)?;
    write(&out.join("ca.key"), &ca_key.serialize_pem(), true)?;
    let issuer = Issuer::new(ca, ca_key);

    let leaf = |names: &[String], common: &str, uses: Vec<ExtendedKeyUsagePurpose>| -> Result<(String, String)> {
        let key = KeyPair::generate().context("generating a key")?;
        let mut p = CertificateParams::new(names.to_vec()).with_context(|| format!("certificate names {names:?}"))?;
        p.distinguished_name.push(DnType::CommonName, common);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = uses;
        let cert = p.signed_by(&key, &issuer).with_context(|| format!("signing the {common} certificate"))?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    // Coordinators and workers serve, and the coordinator is also a client of the workers.
    let (cert, key) =
        leaf(hosts, "tessera-server", vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth])?;
    write(&files.server_cert, &cert, false)?;
    write(&files.server_key, &key, true)?;
    let (cert, key) = leaf(&[], "tessera-gateway", vec![ExtendedKeyUsagePurpose::ClientAuth])?;
    write(&files.client_cert, &cert, false)?;
    write(&files.client_key, &key, true)?;
    Ok(files)
}

/// Writes `text` to `path`; a private key readable by its owner only.
fn write(path: &Path, text: &str, private: bool) -> Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if private { 0o600 } else { 0o644 });
    }
    use std::io::Write;
    let mut f = opts.open(path).with_context(|| format!("writing {}", path.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// A fresh, empty directory for a test (under the system temp dir).
#[cfg(test)]
pub fn test_dir(name: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "tessera-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a test directory");
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makes_pem_files_and_keeps_keys_private() {
        let dir = test_dir("certs");
        let files = make(&dir, &["localhost".into(), "127.0.0.1".into()]).unwrap();
        for p in [&files.ca_cert, &files.server_cert, &files.client_cert] {
            let text = std::fs::read_to_string(p).unwrap();
            assert!(text.starts_with("-----BEGIN CERTIFICATE-----"), "{}", p.display());
        }
        for p in [&files.server_key, &files.client_key, &dir.join("ca.key")] {
            let text = std::fs::read_to_string(p).unwrap();
            assert!(text.contains("PRIVATE KEY-----"), "{}", p.display());
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                assert_eq!(std::fs::metadata(p).unwrap().permissions().mode() & 0o777, 0o600, "{}", p.display());
            }
        }
        // A name that cannot be a DNS name (not ASCII) is refused, not written.
        let bad = test_dir("certs-bad");
        assert!(make(&bad, &["hôte.example".into()]).is_err());
        let _ = std::fs::remove_dir_all(&bad);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
