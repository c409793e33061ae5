//! Test credentials in QEMU's `tls-creds-x509` layout, made with the openssl CLI: a CA, a
//! server certificate for localhost / 127.0.0.1 and a client certificate (subject CN
//! `cryptblk test client`), and more client certificates with names of the test's choosing.
//! Shared by the test suites of every crate that speaks TLS.

use std::path::Path;
use std::process::Command;

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl must be installed to make test certificates");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A client's credentials directory in QEMU's layout (`ca-cert.pem`, `client-cert.pem`,
/// `client-key.pem`) at `out`, its certificate signed by the CA in `ca_dir` (made by
/// [`make_credentials`]) for subject CN `cn` and, if given, the DNS subjectAltName `dns`.
pub fn make_client_credentials(ca_dir: &Path, out: &Path, cn: &str, dns: Option<&str>) {
    std::fs::create_dir_all(out).unwrap();
    let p = |d: &Path, n: &str| d.join(n).to_str().unwrap().to_owned();
    let (key, csr, cert, cnf) = (
        p(out, "client-key.pem"),
        p(out, "client.csr"),
        p(out, "client-cert.pem"),
        p(out, "client-ext.cnf"),
    );
    let subject = format!("/CN={cn}");
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &csr,
        "-subj",
        &subject,
    ]);
    let mut ext = String::from(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
         extendedKeyUsage=clientAuth\n",
    );
    if let Some(dns) = dns {
        ext.push_str(&format!("subjectAltName=DNS:{dns}\n"));
    }
    std::fs::write(&cnf, ext).unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &p(ca_dir, "ca-cert.pem"),
        "-CAkey",
        &p(ca_dir, "ca-key.pem"),
        "-CAcreateserial",
        "-out",
        &cert,
        "-days",
        "2",
        "-extfile",
        &cnf,
    ]);
    std::fs::copy(ca_dir.join("ca-cert.pem"), out.join("ca-cert.pem")).unwrap();
}

/// Writes `ca-cert.pem`, `server-{cert,key}.pem` and `client-{cert,key}.pem` into `dir`. CAs
/// made with different `ca_name`s do not trust each other's certificates.
pub fn make_credentials(dir: &Path, ca_name: &str) {
    let p = |n: &str| dir.join(n).to_str().unwrap().to_owned();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let subject = format!("/CN={ca_name}");
    let (ca_key, ca_cert) = (p("ca-key.pem"), p("ca-cert.pem"));
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout", &ca_key, "-out", &ca_cert, "-days", "2", "-subj", &subject,
    ]);
    ca.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
    ca.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
    openssl(&ca);
    for (who, ext) in [
        (
            "server",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        ),
        (
            "client",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        ),
    ] {
        let (key, csr, cert, cnf) = (
            p(&format!("{who}-key.pem")),
            p(&format!("{who}.csr")),
            p(&format!("{who}-cert.pem")),
            p(&format!("{who}-ext.cnf")),
        );
        let cn = format!("/CN=cryptblk test {who}");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", &cn]);
        openssl(&req);
        std::fs::write(&cnf, ext).unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &p("ca-cert.pem"),
            "-CAkey",
            &p("ca-key.pem"),
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &cnf,
        ]);
    }
}
