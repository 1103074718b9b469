//! CUDA graphs: a sequence of ops queued on the device's stream, recorded once and
//! replayed with one launch. A decode step is ~300 kernels; launched one by one they cost
//! the host several µs each (ANCHORS.md: ~7.5 µs eager vs ~0.9 µs inside a graph), more
//! than a small GPU step takes. Replays read and write the same buffers the capture saw,
//! so callers keep a graph's inputs in fixed buffers and overwrite them before a replay.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::device::{dev_err, Device};
use crate::KernelError;

/// A captured, instantiated sequence of ops of one [`Device`].
pub struct Graph {
    inner: CudaGraph,
}

// SAFETY: a graph is only launched through `&Device` by whoever owns it; the owner
// serialises access (`&mut` or a lock), which is all CUDA requires of graph objects.
unsafe impl Send for Graph {}

impl Device {
    /// Records every op `f` queues on the stream (nothing runs), then instantiates the
    /// graph. `f` must not allocate, copy from the host or synchronise: those are not
    /// capturable. Capture always ends, also when `f` fails.
    pub fn capture(&self, f: impl FnOnce() -> Result<(), KernelError>) -> Result<Graph, KernelError> {
        const OP: &str = "cuda_graph_capture";
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(dev_err(OP))?;
        let recorded = f();
        let ended = self.stream.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        let graph = ended
            .map_err(dev_err(OP))?
            .ok_or_else(|| KernelError::Device { op: OP, detail: "the capture recorded no graph".into() })?;
        graph.upload().map_err(dev_err(OP))?;
        Ok(Graph { inner: graph })
    }

    /// Queues one replay of `graph` on the stream.
    pub fn launch_graph(&self, graph: &Graph) -> Result<(), KernelError> {
        graph.inner.launch().map_err(dev_err("cuda_graph_launch"))
    }
}
