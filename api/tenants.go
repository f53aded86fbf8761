package api

import "github.com/kvrouter/kvrouter/api/tenant"

// Tenants and their fair shares across the fleet (issue 28 item 3): the
// ledger lives in package tenant (pure bookkeeping, shared with kvbench
// sim, which runs the same code over simulated replicas); these names keep
// api's side of the contract (serve's flags, replica sync) as it was.

// TenantSource says where a request's tenant comes from.
type TenantSource = tenant.Source

// Tenant sources (--tenant-from).
const (
	TenantNone   = tenant.SourceNone   // fairness off: every request is one tenant
	TenantAPIKey = tenant.SourceAPIKey // the client's bearer key, hashed
	TenantHeader = tenant.SourceHeader // the value of TenantConfig.Header
)

// DefaultTenantHeader is GAIE's flow-control fairness id header.
const DefaultTenantHeader = tenant.DefaultHeader

// Special tenant ids.
const (
	TenantAnonymous = tenant.Anonymous // no key or no header
	TenantOverflow  = tenant.Overflow  // beyond MaxTenants: one shared share
)

// maxPublishedTenants bounds one replica's sync message.
const maxPublishedTenants = tenant.MaxPublished

type (
	// TenantConfig configures tenant fairness (tenant.Config).
	TenantConfig = tenant.Config
	// TenantUsage is one tenant's state on one replica, as replica sync
	// carries it (tenant.Usage).
	TenantUsage = tenant.Usage
	// TenantLedger keeps the tenants' virtual token counters
	// (tenant.Ledger).
	TenantLedger = tenant.Ledger
	// TenantStatus is one tenant of /cluster/status (tenant.Status).
	TenantStatus = tenant.Status
)

// NewTenantLedger returns an empty ledger; nil when cfg.From is none or
// empty (fairness off).
func NewTenantLedger(cfg TenantConfig) (*TenantLedger, error) { return tenant.New(cfg) }
