//! The Vulkan device for tests of chains of command buffers (`gpu::chain`).

use std::sync::Arc;

use spillway_daemon::gpu::Device;

/// The machine's Vulkan device where it runs chains (timeline semaphores, core in Vulkan 1.2);
/// `None` to skip without one, which fails where `SPILLWAY_REQUIRE_VULKAN` is set.
pub fn chain_device() -> Option<Arc<Device>> {
    let dev = spillway_daemon::gpu::device_or_skip()?;
    if !dev.chains() {
        assert!(
            std::env::var_os("SPILLWAY_REQUIRE_VULKAN").is_none(),
            "the Vulkan device has no timeline semaphores"
        );
        return None;
    }
    Some(dev)
}
