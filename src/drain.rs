//! The end of a gRPC role's life on SIGTERM: tonic's graceful shutdown stops accepting
//! connections and lets the open streams run on; this bounds how long they may, so a peer
//! that never hangs up (a coordinator keeps its Step streams open while it lives) cannot
//! keep the process alive past its drain timeout. [`RefuseWhenNotReady`] turns new work
//! away on the connections that stay open meanwhile.

use std::future::Future;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{ready, Either, Ready};
use tessera_telemetry::Readiness;
use tonic::codegen::http;

/// Runs `server` (whose graceful shutdown starts on SIGTERM) until it ends, or until
/// `bound` after SIGTERM, whichever comes first. `role` names the process in the message.
pub async fn serve_bounded<E: std::error::Error + Send + Sync + 'static>(
    role: &str,
    server: impl Future<Output = Result<(), E>>,
    bound: Duration,
) -> anyhow::Result<()> {
    tokio::pin!(server);
    let expired = async {
        tessera_gateway::serve::shutdown_signal().await;
        tokio::time::sleep(bound).await;
    };
    tokio::select! {
        r = &mut server => r?,
        _ = expired => tracing::warn!("tessera {role}: streams still open {} s after SIGTERM; exiting", bound.as_secs()),
    }
    Ok(())
}

/// A tower layer for a tonic server: calls to the gRPC methods in `paths` (e.g.
/// `/tessera.worker.v1.Worker/Load`) are refused with UNAVAILABLE and `retry-after`
/// while `ready` is false; every other call passes.
#[derive(Clone)]
pub struct RefuseWhenNotReady {
    ready: Readiness,
    paths: &'static [&'static str],
}

impl RefuseWhenNotReady {
    pub fn new(ready: Readiness, paths: &'static [&'static str]) -> Self {
        RefuseWhenNotReady { ready, paths }
    }
}

impl<S> tower::Layer<S> for RefuseWhenNotReady {
    type Service = Refusing<S>;

    fn layer(&self, inner: S) -> Refusing<S> {
        Refusing { inner, ready: self.ready.clone(), paths: self.paths }
    }
}

/// The service of [`RefuseWhenNotReady`].
#[derive(Clone)]
pub struct Refusing<S> {
    inner: S,
    ready: Readiness,
    paths: &'static [&'static str],
}

impl<S, B, R> tower::Service<http::Request<B>> for Refusing<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Either<Ready<Result<http::Response<R>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !self.ready.is_ready() && self.paths.contains(&req.uri().path()) {
            let mut status = tonic::Status::unavailable("shutting down: no new work is taken");
            status.metadata_mut().insert("retry-after", tonic::metadata::MetadataValue::from_static("1"));
            return Either::Left(ready(Ok(status.into_http())));
        }
        Either::Right(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use tower::{Layer, ServiceExt};

    use super::*;

    const LOAD: &str = "/tessera.worker.v1.Worker/Load";

    async fn call(ready: &Readiness, path: &str) -> http::Response<String> {
        let inner = tower::service_fn(|_req: http::Request<()>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new("served".to_string()))
        });
        let svc = RefuseWhenNotReady::new(ready.clone(), &[LOAD]).layer(inner);
        svc.oneshot(http::Request::builder().uri(path).body(()).unwrap()).await.unwrap()
    }

    #[tokio::test]
    async fn listed_methods_are_refused_only_while_not_ready() {
        let ready = Readiness::new(true);
        assert_eq!(call(&ready, LOAD).await.body(), "served");
        ready.set(false);
        let refused = call(&ready, LOAD).await;
        assert_eq!(refused.body(), "", "the inner service was not called");
        let code = refused.headers().get("grpc-status").and_then(|v| v.to_str().ok());
        assert_eq!(code, Some("14"), "UNAVAILABLE");
        assert_eq!(refused.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        assert_eq!(call(&ready, "/tessera.worker.v1.Worker/Step").await.body(), "served", "open streams go on");
    }
}
