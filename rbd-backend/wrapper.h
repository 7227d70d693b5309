/* Headers the checked-in bindings (src/ffi/bindings.rs) are generated from:
 * Debian 12 librados-dev / librbd-dev 16.2.15 (librbd 1.16). */
#include <rados/librados.h>
#include <rbd/librbd.h>
