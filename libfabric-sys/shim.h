/* Non-inline wrappers over libfabric's static inline calls (libfabric 1.x). */
#ifndef DM_FI_SHIM_H
#define DM_FI_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) of the headers built against. */
uint32_t dm_fi_version(void);
/* FI_ADDR_UNSPEC (a cast macro that bindgen cannot evaluate). */
uint64_t dm_fi_addr_unspec(void);

struct fi_info *dm_fi_allocinfo(void);
/* strdup()s `name` into info->fabric_attr->prov_name (freed by fi_freeinfo). */
int dm_fi_info_set_prov_name(struct fi_info *info, const char *name);

int dm_fi_getinfo(uint32_t version, const char *node, const char *service,
                  uint64_t flags, const struct fi_info *hints,
                  struct fi_info **info);
void dm_fi_freeinfo(struct fi_info *info);
const char *dm_fi_strerror(int errnum);

int dm_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
                 void *context);
int dm_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
                 struct fid_domain **domain, void *context);
int dm_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
                   struct fid_ep **ep, void *context);
int dm_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
                  struct fid_av **av, void *context);
int dm_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
                  struct fid_cq **cq, void *context);
int dm_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int dm_fi_enable(struct fid_ep *ep);
int dm_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
                 uint64_t access, uint64_t offset, uint64_t requested_key,
                 uint64_t flags, struct fid_mr **mr, void *context);
uint64_t dm_fi_mr_key(struct fid_mr *mr);
void *dm_fi_mr_desc(struct fid_mr *mr);
int dm_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
                    fi_addr_t *fi_addr, uint64_t flags, void *context);
int dm_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
ssize_t dm_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
                   fi_addr_t src_addr, uint64_t addr, uint64_t key,
                   void *context);
ssize_t dm_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t dm_fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, int timeout_ms);
ssize_t dm_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
                         uint64_t flags);
const char *dm_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
                              const void *err_data, char *buf, size_t len);
int dm_fi_close(struct fid *fid);

#endif
