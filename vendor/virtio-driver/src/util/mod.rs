// SPDX-License-Identifier: (MIT OR Apache-2.0)

pub mod bytevalued;
pub mod endian;
pub mod eventfd;
pub mod iova;
pub mod sock_ctrl_msg;
