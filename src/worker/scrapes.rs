//! The metrics endpoint's HTTP side: `GET /metrics` answered on one thread of its own, one
//! connection at a time, each bounded in size and time, so that no client — slow, flooding or
//! hostile — can take memory, threads or the worker with it. The request head is parsed by
//! httparse; a request with a body is refused unread. The thread never calls into PostgreSQL.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// The most a request head may take, and how long a connection may take in all.
const MAX_HEAD: usize = 8 * 1024;
const CONNECTION_TIME: Duration = Duration::from_secs(5);
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Listens on `address` and answers scrapes with `render()` on a thread started with every
/// signal blocked; the error says why it could not.
pub fn serve(
    address: SocketAddr,
    render: impl Fn() -> Option<String> + Send + 'static,
) -> Result<(), String> {
    let listener =
        TcpListener::bind(address).map_err(|e| format!("cannot listen on {address}: {e}"))?;
    crate::threads::with_signals_blocked(|| {
        std::thread::Builder::new()
            .name("outbox_ext metrics".into())
            .spawn(move || answer_all(&listener, &render))
    })
    .map(drop)
    .map_err(|e| format!("cannot start its thread: {e}"))
}

fn answer_all(listener: &TcpListener, render: &dyn Fn() -> Option<String>) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = answer(stream, render); // a client that went away: the next one
            }
            // e.g. out of file descriptors: keep the endpoint, try again shortly
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn answer(mut stream: TcpStream, render: &dyn Fn() -> Option<String>) -> std::io::Result<()> {
    let deadline = Instant::now() + CONNECTION_TIME;
    let reply = match read_head(&mut stream, deadline)? {
        Some(head) => reply_to(&head, render),
        None => Reply::error(
            "431 Request Header Fields Too Large",
            "request head too large\n",
        ),
    };
    let response = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        reply.status,
        reply.content_type,
        reply.body.len(),
        reply.body
    );
    stream.set_write_timeout(Some(CONNECTION_TIME))?;
    stream.write_all(response.as_bytes())
}

/// The request head (through its blank line), or None when it exceeds MAX_HEAD. An error when
/// the client is too slow or goes away.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Some(head))
}

struct Reply {
    status: &'static str,
    content_type: &'static str,
    body: String,
}

impl Reply {
    fn error(status: &'static str, body: &str) -> Reply {
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_owned(),
        }
    }
}

fn reply_to(head: &[u8], render: &dyn Fn() -> Option<String>) -> Reply {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    if !matches!(request.parse(head), Ok(httparse::Status::Complete(_))) {
        return Reply::error("400 Bad Request", "malformed request\n");
    }
    let has_body = request.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("transfer-encoding")
            || (h.name.eq_ignore_ascii_case("content-length") && h.value.trim_ascii() != b"0")
    });
    if has_body {
        return Reply::error("400 Bad Request", "a scrape has no body\n");
    }
    if request.method != Some("GET") {
        return Reply::error(
            "405 Method Not Allowed",
            "only GET /metrics is served here\n",
        );
    }
    let path = request.path.unwrap_or_default();
    if path.split('?').next() != Some("/metrics") {
        return Reply::error("404 Not Found", "only GET /metrics is served here\n");
    }
    match render() {
        Some(body) => Reply {
            status: "200 OK",
            content_type: CONTENT_TYPE,
            body,
        },
        None => Reply::error("500 Internal Server Error", "encoding failed\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::reply_to;

    fn status(head: &str) -> &'static str {
        reply_to(head.as_bytes(), &|| Some("m".into())).status
    }

    #[test]
    fn only_a_get_of_metrics_without_a_body_is_answered() {
        assert_eq!(status("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), "200 OK");
        assert_eq!(status("GET /metrics?x=1 HTTP/1.0\r\n\r\n"), "200 OK");
        assert_eq!(
            status("GET /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
            "200 OK"
        );
        assert_eq!(status("GET /other HTTP/1.1\r\n\r\n"), "404 Not Found");
        assert_eq!(
            status("POST /metrics HTTP/1.1\r\n\r\n"),
            "405 Method Not Allowed"
        );
        let huge = "GET /metrics HTTP/1.1\r\nContent-Length: 70000000000000\r\n\r\n";
        assert_eq!(status(huge), "400 Bad Request");
        let chunked = "GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(status(chunked), "400 Bad Request");
        assert_eq!(status("nonsense\r\n\r\n"), "400 Bad Request");
    }
}
