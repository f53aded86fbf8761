// Package splitmix holds SplitMix64's two steps (Steele, Lea and Flood,
// "Fast splittable pseudorandom number generators", 2014), which several
// packages use to spread hashes and seeds: Mix, its output function (a
// bijection on uint64), and Next, one step of its sequence.
package splitmix

// Gamma is SplitMix64's increment (the golden ratio's fraction in 64 bits).
const Gamma = 0x9e3779b97f4a7c15

// Mix is SplitMix64's output function: a bijection on uint64 whose output
// bits each depend on every input bit, so distinct inputs stay distinct and
// nearby ones land far apart.
func Mix(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// Next is one step of SplitMix64 from state x: Mix(x + Gamma).
func Next(x uint64) uint64 { return Mix(x + Gamma) }
