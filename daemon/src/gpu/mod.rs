//! The Vulkan backend, through `ash`.
