package replica

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/fsm"
)

// TestReplicaPinLimitsAgree: the api builds pins within the FSM's rules
// (its block cap and TTL range), so a pin it asks for is never refused by
// them after the proposal.
func TestReplicaPinLimitsAgree(t *testing.T) {
	if api.MaxPinBlocks != fsm.MaxPinBlocks || int64(api.MaxPinTTL) != fsm.MaxPinTTL || int64(time.Second) != fsm.MinPinTTL ||
		int64(api.DefaultPinTTL) > fsm.MaxPinTTL {
		t.Fatalf("api pins %d blocks for up to %s; the FSM takes %d blocks for %d..%d ns",
			api.MaxPinBlocks, api.MaxPinTTL, fsm.MaxPinBlocks, fsm.MinPinTTL, fsm.MaxPinTTL)
	}
}
