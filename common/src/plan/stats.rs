//! The planner's statistics, pure functions over slices: medians, the trimmed mean, the
//! relative spread (from the median absolute deviation), the least-squares line and Spearman's
//! rank correlation. The profile's timing loops ([`super::profile`]) and the check of a plan
//! against its runs ([`super::check`]) call them; nothing here times or talks.

/// The median (the mean of the middle two for an even count); NaN for none.
pub fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The upper median of `values`, sorting them in place: the middle one for an odd count, the
/// higher of the middle two for an even one (a value that was measured, never a mean of two).
/// Panics on none.
pub fn upper_median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The mean of `values` less their fastest and slowest (one each), sorting them in place.
/// NaN for fewer than 3.
pub fn trimmed_mean(values: &mut [f64]) -> f64 {
    if values.len() < 3 {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let middle = &values[1..values.len() - 1];
    middle.iter().sum::<f64>() / middle.len() as f64
}

/// 1.4826 × the median absolute deviation over the (upper) median: a normal sample's relative
/// σ, robust to a few outliers. 0 for fewer than 2 times.
pub fn relative_spread(times: &[f64]) -> f64 {
    if times.len() < 2 {
        return 0.0;
    }
    let middle = upper_median(&mut times.to_vec());
    let deviation = upper_median(&mut times.iter().map(|t| (t - middle).abs()).collect::<Vec<f64>>());
    if middle > 0.0 {
        1.4826 * deviation / middle
    } else {
        0.0
    }
}

/// The least-squares line through `points` (x, y) as (intercept, slope), its intercept kept at
/// zero or above: where the free line's would be negative, the line through the origin
/// instead. A slope of 0 where the x do not vary.
pub fn least_squares_line(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let (mean_x, mean_y) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    if mean_y - slope * mean_x >= 0.0 {
        (mean_y - slope * mean_x, slope)
    } else {
        // Through the origin instead.
        (0.0, points.iter().map(|p| p.0 * p.1).sum::<f64>() / points.iter().map(|p| p.0 * p.0).sum::<f64>().max(f64::MIN_POSITIVE))
    }
}

/// Each value's rank from 1, ties sharing the mean of the ranks they span.
fn ranks(values: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut ranks = vec![0.0; values.len()];
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && values[order[end]] == values[order[start]] {
            end += 1;
        }
        let shared = (start + end + 1) as f64 / 2.0;
        for &i in &order[start..end] {
            ranks[i] = shared;
        }
        start = end;
    }
    ranks
}

/// Spearman's rank correlation: Pearson's of the ranks (ties averaged). NaN for fewer than two
/// values or a ranking without spread.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "two rankings of the same layouts");
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let (va, vb): (f64, f64) = (ra.iter().map(|x| (x - ma).powi(2)).sum(), rb.iter().map(|y| (y - mb).powi(2)).sum());
    cov / (va * vb).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_is_one_for_the_same_order_minus_one_for_the_reverse_and_averages_ties() {
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 30.0, 400.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // Two swapped of five: 1 − 6·Σd²/(n(n²−1)) = 1 − 6·2/120 = 0.9.
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[2.0, 1.0, 3.0, 4.0, 5.0]) - 0.9).abs() < 1e-12);
        assert_eq!(ranks(&[5.0, 1.0, 5.0, 2.0]), vec![3.5, 1.0, 3.5, 2.0]);
        assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan(), "no spread, no correlation");
    }

    #[test]
    fn the_median_averages_the_middle_two_and_the_upper_median_takes_the_higher() {
        assert_eq!(median([3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median([]).is_nan());
        assert_eq!(upper_median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(upper_median(&mut [3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn the_trimmed_mean_drops_one_fastest_and_one_slowest() {
        assert_eq!(trimmed_mean(&mut [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 9.0]), 1.4);
        assert_eq!(trimmed_mean(&mut [100.0, 2.0, 0.0]), 2.0);
        assert!(trimmed_mean(&mut [1.0, 2.0]).is_nan());
    }

    #[test]
    fn the_spread_is_a_normal_samples_relative_sigma_and_one_stall_does_not_set_it() {
        // Deviations from the median 1.0: 0.1, 0, 0.1; their median 0.1; × 1.4826.
        assert!((relative_spread(&[0.9, 1.0, 1.1]) - 0.14826).abs() < 1e-12);
        // One pass stalled fivefold among equal ones: no spread.
        assert_eq!(relative_spread(&[1.0, 1.0, 5.0, 1.0, 1.0]), 0.0);
        assert_eq!(relative_spread(&[2.0]), 0.0);
        // Scaling every time scales nothing.
        assert!((relative_spread(&[9.0, 10.0, 11.0]) - 0.14826).abs() < 1e-12);
    }

    #[test]
    fn the_line_fit_recovers_its_line_and_never_crosses_zero_below() {
        let points: Vec<(f64, f64)> = [1.0, 2.0, 5.0, 9.0].iter().map(|&x| (x, 3.0 + 0.5 * x)).collect();
        let (intercept, slope) = least_squares_line(&points);
        assert!((intercept - 3.0).abs() < 1e-12 && (slope - 0.5).abs() < 1e-12, "{intercept} {slope}");
        // y = 2x − 1 would cross zero below: through the origin, Σxy/Σx² instead.
        let (intercept, slope) = least_squares_line(&[(1.0, 1.0), (2.0, 3.0)]);
        assert_eq!(intercept, 0.0);
        assert!((slope - 7.0 / 5.0).abs() < 1e-12);
        // The x do not vary: no slope.
        assert_eq!(least_squares_line(&[(2.0, 1.0), (2.0, 3.0)]), (2.0, 0.0));
    }
}
