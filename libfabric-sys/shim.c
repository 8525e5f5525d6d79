/* Non-inline wrappers over libfabric's static inline calls; see shim.h. */
#include <stdlib.h>
#include <string.h>

#include "shim.h"

uint32_t dm_fi_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }

uint64_t dm_fi_addr_unspec(void) { return FI_ADDR_UNSPEC; }

struct fi_info *dm_fi_allocinfo(void) { return fi_allocinfo(); }

int dm_fi_info_set_prov_name(struct fi_info *info, const char *name)
{
	char *copy;

	if (!info || !info->fabric_attr || !name)
		return -FI_EINVAL;
	copy = strdup(name);
	if (!copy)
		return -FI_ENOMEM;
	free(info->fabric_attr->prov_name);
	info->fabric_attr->prov_name = copy;
	return 0;
}

int dm_fi_getinfo(uint32_t version, const char *node, const char *service,
		  uint64_t flags, const struct fi_info *hints,
		  struct fi_info **info)
{
	return fi_getinfo(version, node, service, flags, hints, info);
}

void dm_fi_freeinfo(struct fi_info *info) { fi_freeinfo(info); }

const char *dm_fi_strerror(int errnum) { return fi_strerror(errnum); }

int dm_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
		 void *context)
{
	return fi_fabric(attr, fabric, context);
}

int dm_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
		 struct fid_domain **domain, void *context)
{
	return fi_domain(fabric, info, domain, context);
}

int dm_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
		   struct fid_ep **ep, void *context)
{
	return fi_endpoint(domain, info, ep, context);
}

int dm_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
		  struct fid_av **av, void *context)
{
	return fi_av_open(domain, attr, av, context);
}

int dm_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
		  struct fid_cq **cq, void *context)
{
	return fi_cq_open(domain, attr, cq, context);
}

int dm_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{
	return fi_ep_bind(ep, bfid, flags);
}

int dm_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }

int dm_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
		 uint64_t access, uint64_t offset, uint64_t requested_key,
		 uint64_t flags, struct fid_mr **mr, void *context)
{
	return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags,
			 mr, context);
}

uint64_t dm_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }

void *dm_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }

int dm_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
		    fi_addr_t *fi_addr, uint64_t flags, void *context)
{
	return fi_av_insert(av, addr, count, fi_addr, flags, context);
}

int dm_fi_getname(struct fid *fid, void *addr, size_t *addrlen)
{
	return fi_getname(fid, addr, addrlen);
}

ssize_t dm_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
		   fi_addr_t src_addr, uint64_t addr, uint64_t key,
		   void *context)
{
	return fi_read(ep, buf, len, desc, src_addr, addr, key, context);
}

ssize_t dm_fi_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
	return fi_cq_read(cq, buf, count);
}

ssize_t dm_fi_cq_sread(struct fid_cq *cq, void *buf, size_t count, int timeout_ms)
{
	return fi_cq_sread(cq, buf, count, NULL, timeout_ms);
}

ssize_t dm_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
			 uint64_t flags)
{
	return fi_cq_readerr(cq, buf, flags);
}

const char *dm_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
			      const void *err_data, char *buf, size_t len)
{
	return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}

int dm_fi_close(struct fid *fid) { return fi_close(fid); }
