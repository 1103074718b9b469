//! Test doubles for the gateway's two seams, public so other crates' tests (and a
//! model-less demo) can use them: `ByteCodec` (one token per byte) and `FakeEngine`
//! (scripted events, records requests and aborts).

mod byte_codec;
mod fake_engine;

pub use byte_codec::{ByteCodec, BOS, EOS, VOCAB};
pub use fake_engine::{reply_steps, FakeEngine, FakeLog, FakeStep};
