package extproc

import (
	"context"

	"github.com/kvrouter/kvrouter/api"
)

// Adapt makes the replica's API server the Picker: its Pick is the proxy's
// own routing step (api/picker.go), so a request placed here goes where
// the proxy would have sent it.
func Adapt(s *api.Server) Picker { return apiPicker{s} }

type apiPicker struct{ s *api.Server }

func (a apiPicker) Pick(ctx context.Context, r Request) (Placement, error) {
	pk, err := a.s.Pick(ctx, api.PickRequest(r))
	if err != nil {
		return nil, err // an *api.PickError is a Refusal
	}
	return apiPlacement{pk}, nil
}

func (a apiPicker) Any() (string, bool) { return a.s.AnyEndpoint() }

// apiPlacement is an *api.Pick as a Placement.
type apiPlacement struct{ *api.Pick }

func (p apiPlacement) Endpoints() []string { return p.Pick.Endpoints }
func (p apiPlacement) Worker() string      { return string(p.Pick.Worker()) }
func (p apiPlacement) DPRank() (int, bool) { return p.Pick.Rank, p.Pick.HasRank }

var _ Refusal = (*api.PickError)(nil)
