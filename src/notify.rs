//! systemd's readiness protocol (`Type=notify`): once the mount answers, the daemon sends
//! `READY=1` to the datagram socket named by `$NOTIFY_SOCKET`, so units ordered after it
//! (an engine) start only when the view is there. Without the variable it does nothing.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

pub const SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Send `message` to `$NOTIFY_SOCKET`: a path, or `@name` for the abstract namespace.
pub fn send(message: &str) -> std::io::Result<bool> {
    let Some(target) = std::env::var_os(SOCKET_ENV) else {
        return Ok(false);
    };
    let target = target.to_string_lossy().into_owned();
    let addr = match target.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
        None => SocketAddr::from_pathname(&target)?,
    };
    let sock = UnixDatagram::unbound()?;
    sock.send_to_addr(message.as_bytes(), &addr)?;
    Ok(true)
}

/// Tell the service manager the mount is ready; a failure is logged, never fatal.
pub fn ready(mount_point: &std::path::Path) {
    let status = format!(
        "READY=1\nSTATUS=serving {}\nMAINPID={}",
        mount_point.display(),
        std::process::id()
    );
    match send(&status) {
        Ok(true) => log::debug!("told the service manager the mount is ready"),
        Ok(false) => {}
        Err(e) => log::warn!("cannot notify the service manager ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test owns the variable: tests run in parallel threads of one process.
    #[test]
    fn ready_reaches_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        std::env::set_var(SOCKET_ENV, &path);
        ready(std::path::Path::new("/mnt/model"));
        let mut buf = [0u8; 256];
        let n = listener.recv(&mut buf).unwrap();
        let got = std::str::from_utf8(&buf[..n]).unwrap();
        assert!(
            got.starts_with("READY=1\nSTATUS=serving /mnt/model\nMAINPID="),
            "{got}"
        );

        let name = format!("kllm-notify-test-{}", std::process::id());
        let abstract_listener =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        std::env::set_var(SOCKET_ENV, format!("@{name}"));
        assert!(send("READY=1").unwrap());
        let n = abstract_listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        std::env::remove_var(SOCKET_ENV);
        assert!(!send("READY=1").unwrap());
    }
}
