/* Headers the checked-in bindings (src/ffi/bindings.rs) are generated from:
 * Debian 12 libibverbs-dev / librdmacm-dev 44.0 (rdma-core 44). */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
