package router

import "time"

// decideBench is the decision the Select benchmarks time: DecideInto, the
// rows of the last decision reused (a base commit without DecideInto
// benchmarks through a copy of this file calling Decide).
func decideBench(r *Router, req Request, now time.Time, rows []WorkerCost) (Decision, error) {
	return r.DecideInto(req, now, rows)
}
