//! Observability shared by every Tessera role (gateway, coordinator, worker): metrics in
//! Prometheus text format, the small admin HTTP endpoint (`/health`, `/ready`, `/metrics`)
//! of the roles that do not serve HTTP themselves, OpenTelemetry traces and structured logs.
